/* Q5_0 weights (`pack_q50`; quant_blocks.c and experts.c drive them): y[M, N] = x[M, K] @ w[N, K]^T with llama.cpp's
 * 5-bit values exactly, w = d * (q - 16): per 32 columns an fp16 d an output, q in [0, 31]. K % 64 == 0.
 *
 * Why its own layout: llama.cpp's Q4_K_M keeps a tensor whose rows are not a multiple of 256 at Q5_0 (DeepSeek-V2's
 * experts' down projections, 1408 columns; attn_k_b), which as int8 per row read 8 bits a weight where the file
 * holds 5.5, and rounded the values again. Here a weight reads 5.5 bits, the file's d as it is (fp16).
 *
 * Layout: the outputs in blocks of 16 (N padded with zero rows), each block one stream of bytes; per group of 32
 * columns (Q50_GROUP bytes) the 16 outputs' d (32 bytes of fp16), 64 bytes of fifth bits, then four 64-byte units of
 * nibbles as int4's: unit c byte 4j + i = low 4 bits of q[j, 8c + i] | those of q[j, 8c + 4 + i] << 4. The fifth
 * bits' byte 4j + i holds in bit 2c + h that of q[j, 8c + 4h + i]: each unit's half finds its fifth bits at the same
 * byte, one shift away from bit 4. One 64-byte load feeds all 16 outputs against 4 columns of x broadcast to every
 * lane, as int4's.
 *
 * The activations are int4's (int8 per 64 columns, quant_acts.c) with per 32 columns -16 * the sum of their quantized
 * x (as int32), which starts a group's integer sum, so that it is the sum of (q - 16) * xq with q as the unsigned
 * operand of vpdpbusd (AVX2: vpmaddubsw). Per group the sum,
 * times d times x's scale, goes into the row's sums. Same operations in the same order on every build: the same bits
 * on AVX2 and AVX-512. */
#include "quant.h"

#define Q50_UNITS 4 /* 64-byte units of nibbles a group: 8 columns each */
/* Rows up to which a pair of blocks runs group by group (two streams in flight); from more, one block after the
 * other: a pair's sums of both blocks outgrow the registers. */
#define Q50_PAIR_ROWS 2

/* Row r of a's quantized rows, scales and centres (per 32 columns). */
#define Q50_ROW(a, r, K) (a).q + (r) * (K), (a).s + (r) * ((K) / XBLOCK), (const int32_t *)(a).corr + (r) * ((K) / 32)

#ifdef LS_AVX512
#define Q50ROWS 8 /* activation rows a pass: an accumulator and a sum each */

/* q with 16 added where bit r of hb's byte is set: the fifth bits (a byte mask, then a masked add). */
INLINE __m512i q50_fifth(__m512i q, __m512i hb, int r) {
    return _mm512_mask_add_epi8(q, _mm512_test_epi8_mask(hb, _mm512_set1_epi8((char)(1 << r))), q,
                                _mm512_set1_epi8(0x10));
}

/* res[i][j] += group g's part of output j of a block for activation row i (xq, xs, cen: row 0's; rows K, K / 64,
 * K / 32 apart), its bytes at p. Unit c's two vectors of q (16 outputs; columns 8c .. 8c + 3, then 8c + 4 .. 8c + 7)
 * are unpacked and met by every row before the next unit's. */
INLINE void q50_group(const int8_t *xq, const float *xs, const int32_t *cen, const uint8_t *p, int64_t K, int64_t g,
                      int mb, __m512 *res) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512i hb = _mm512_loadu_si512(p + 32), acc[Q50ROWS];
    for (int i = 0; i < mb; i++) acc[i] = _mm512_set1_epi32(cen[i * (K / 32) + g]);
    for (int c = 0; c < Q50_UNITS; c++) {
        __m512i v = _mm512_loadu_si512(p + 96 + 64 * c);
        __m512i lo = q50_fifth(_mm512_and_si512(v, low), hb, 2 * c);
        __m512i hi = q50_fifth(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), hb, 2 * c + 1);
        for (int i = 0; i < mb; i++) {
            const int8_t *x = xq + i * K + 32 * g + 8 * c;
            acc[i] = _mm512_dpbusd_epi32(acc[i], lo, _mm512_set1_epi32(four_bytes(x)));
            acc[i] = _mm512_dpbusd_epi32(acc[i], hi, _mm512_set1_epi32(four_bytes(x + 4)));
        }
    }
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    for (int i = 0; i < mb; i++) {
        __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(xs[i * (K / XBLOCK) + g / 2]));
        res[i] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(acc[i]), res[i]);
    }
}

INLINE void q50_store(const __m512 *res, int mb, float (*out)[16]) {
    for (int i = 0; i < mb; i++) _mm512_storeu_ps(out[i], res[i]);
}

typedef __m512 Q50Sums[Q50ROWS];
#define Q50_ZERO(res) for (int i = 0; i < mb; i++) res[i] = _mm512_setzero_ps()
#else
#define Q50ROWS 4 /* activation rows a pass: the block's two halves of 8 outputs, a sum each */

/* As the AVX-512 q50_fifth on 256 bits. */
INLINE __m256i q50_fifth(__m256i hb, int r) {
    __m256i at4 = r < 4 ? _mm256_slli_epi16(hb, 4 - r) : r > 4 ? _mm256_srli_epi16(hb, r - 4) : hb;
    return _mm256_and_si256(at4, _mm256_set1_epi8(0x10));
}

/* As the AVX-512 q50_group, each row's 16 outputs as two halves of 8 (res[2 i + h]), a group's halves in turn.
 * Plain AVX2 multiplies with vpmaddubsw: its pairs are at most 2 * 31 * 128 = 7936, two units' four of them 31744 <
 * 32767 in int16: exact, then one vpmaddwd to int32 per two units. */
INLINE void q50_group(const int8_t *xq, const float *xs, const int32_t *cen, const uint8_t *p, int64_t K, int64_t g,
                      int mb, __m256 *res) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int h = 0; h < 2; h++) {
        __m256i hb = _mm256_loadu_si256((const __m256i *)(p + 32 + 32 * h)), acc[Q50ROWS];
#ifndef LS_AVXVNNI
        __m256i pairs[Q50ROWS];
#endif
        for (int i = 0; i < mb; i++) acc[i] = _mm256_set1_epi32(cen[i * (K / 32) + g]);
        for (int c = 0; c < Q50_UNITS; c++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(p + 96 + 64 * c + 32 * h));
            __m256i lo = _mm256_or_si256(_mm256_and_si256(v, low), q50_fifth(hb, 2 * c));
            __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), q50_fifth(hb, 2 * c + 1));
            for (int i = 0; i < mb; i++) {
                const int8_t *x = xq + i * K + 32 * g + 8 * c;
                __m256i x0 = _mm256_set1_epi32(four_bytes(x)), x1 = _mm256_set1_epi32(four_bytes(x + 4));
#ifdef LS_AVXVNNI
                acc[i] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc[i], lo, x0), hi, x1);
#else
                __m256i two = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1));
                pairs[i] = c % 2 == 0 ? two : _mm256_add_epi16(pairs[i], two);
                if (c % 2) acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(pairs[i], _mm256_set1_epi16(1)));
#endif
            }
        }
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16 * h)));
        for (int i = 0; i < mb; i++) {
            __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(xs[i * (K / XBLOCK) + g / 2]));
            res[2 * i + h] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(acc[i]), res[2 * i + h]);
        }
    }
}

INLINE void q50_store(const __m256 *res, int mb, float (*out)[16]) {
    for (int i = 0; i < mb; i++) {
        _mm256_storeu_ps(out[i], res[2 * i]);
        _mm256_storeu_ps(out[i] + 8, res[2 * i + 1]);
    }
}

typedef __m256 Q50Sums[2 * Q50ROWS];
#define Q50_ZERO(res) for (int i = 0; i < 2 * mb; i++) res[i] = _mm256_setzero_ps()
#endif

/* out[i][j] = output j of the block at p for activation row i (xq, xs, cen: row 0's). */
INLINE void q50_block(const int8_t *xq, const float *xs, const int32_t *cen, const uint8_t *p, int64_t K, int mb,
                      float (*out)[16]) {
    Q50Sums res;
    Q50_ZERO(res);
    for (int64_t g = 0; g < K / 32; g++) q50_group(xq, xs, cen, p + g * Q50_GROUP, K, g, mb, res);
    q50_store(res, mb, out);
}

/* q50_block of two blocks, p0 with rows x0 (into out) and p1 with rows x1 (into out1), group by group: two streams
 * of weights in flight, each block's arithmetic as it is alone. */
INLINE void q50_block_pair(const int8_t *x0, const float *xs0, const int32_t *cen0, const int8_t *x1,
                           const float *xs1, const int32_t *cen1, const uint8_t *p0, const uint8_t *p1, int64_t K,
                           float (*out1)[16], int mb, float (*out)[16]) {
    Q50Sums res0, res1;
    Q50_ZERO(res0);
    Q50_ZERO(res1);
    for (int64_t g = 0; g < K / 32; g++) {
        q50_group(x0, xs0, cen0, p0 + g * Q50_GROUP, K, g, mb, res0);
        q50_group(x1, xs1, cen1, p1 + g * Q50_GROUP, K, g, mb, res1);
    }
    q50_store(res0, mb, out);
    q50_store(res1, mb, out1);
}

void q50_block_dots(QuantActs a, int64_t first, int64_t m, const uint8_t *block, int64_t K, float *dots) {
    for (int64_t m0 = 0; m0 < m; m0 += Q50ROWS) {
        int mb = m - m0 < Q50ROWS ? (int)(m - m0) : Q50ROWS;
        float(*out)[16] = (float(*)[16])(dots + 16 * m0);
        FOR_ROWS_UPTO(Q50ROWS, q50_block, Q50_ROW(a, first + m0, K), block, K)
    }
}

void q50_block_pair_dots(QuantActs a0, int64_t first0, QuantActs a1, int64_t first1, int64_t m, const uint8_t *block0,
                         const uint8_t *block1, int64_t K, float *dots0, float *dots1) {
    if (m > Q50_PAIR_ROWS) {
        q50_block_dots(a0, first0, m, block0, K, dots0);
        q50_block_dots(a1, first1, m, block1, K, dots1);
        return;
    }
    for (int64_t m0 = 0; m0 < m; m0 += Q50ROWS) {
        int mb = m - m0 < Q50ROWS ? (int)(m - m0) : Q50ROWS;
        float(*out)[16] = (float(*)[16])(dots0 + 16 * m0), (*out1)[16] = (float(*)[16])(dots1 + 16 * m0);
        FOR_ROWS_UPTO(Q50ROWS, q50_block_pair, Q50_ROW(a0, first0 + m0, K), Q50_ROW(a1, first1 + m0, K), block0, block1,
                      K, out1)
    }
}
