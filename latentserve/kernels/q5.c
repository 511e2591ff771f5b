/* llama.cpp's 5-bit weights (quant_blocks.c and experts.c drive them): y[M, N] = x[M, K] @ w[N, K]^T with the file's
 * values exactly, q in [0, 31] an output and column:
 * - Q5_0 (`pack_q50`, Format (5, 32)): w = d * (q - 16), per 32 columns an fp16 d. K % 64 == 0.
 * - Q5_K (`pack_q5k`, Format (5, 256)): w = d * sc * q - dmin * m, per 256 columns an fp16 d and dmin, per 32 a 6-bit
 *   sc and m. K % 256 == 0.
 *
 * Why their own layouts: as int8 per row a weight read 8 bits where the file holds 5.5 (Q4_K_M keeps a tensor at
 * Q5_0 where its rows are not a multiple of 256: DeepSeek-V2's experts' down projections, 1408 columns; Q5_K_M
 * files are mostly Q5_K), and its values were rounded again.
 *
 * Layout: the outputs in blocks of 16 (N padded with zero rows), each block one stream of bytes. Per group of 32
 * columns (Q5_GROUP bytes) a 32-byte header, 64 bytes of fifth bits, then four 64-byte units of nibbles as int4's:
 * unit c byte 4j + i = low 4 bits of q[j, 8c + i] | those of q[j, 8c + 4 + i] << 4. The fifth bits' byte 4j + i holds
 * in bit 2c + h that of q[j, 8c + 4h + i]: each unit's half finds its fifth bits at the same byte. One 64-byte load
 * feeds all 16 outputs against 4 columns of x broadcast to every lane, as int4's. Q5_0's header is the 16 outputs'
 * d (fp16); Q5_K's their 16 sc then 16 m (a byte each), after, per 256 columns (Q5K_SUPER bytes), the 16 outputs' d
 * and dmin in fp32 (the file's fp16): 5.5 bits a weight (Q5_0, as the file), 5.75 (Q5_K: the file 5.5).
 *
 * The activations are int4's (int8 per 64 columns, quant_acts.c) with per 32 columns -16 * the sum of their quantized
 * x (as int32), which starts a group's integer sum, so that it is the sum of (q - 16) * xq with q as the unsigned
 * operand of vpdpbusd (AVX2: vpmaddubsw); Q5_K's also with the group's exact sum of x. Per group the sum times the
 * scale (Q5_0: d; Q5_K: d * sc, in fp32 as gguf computes it) times x's scale goes into the row's sums, and for Q5_K
 * the exact sum of x times 16 * scale - dmin * m (q = (q - 16) + 16). Same operations in the same order on every
 * build: the same bits on AVX2 and AVX-512. */
#include "quant.h"

#define Q5_UNITS 4 /* 64-byte units of nibbles a group: 8 columns each */
/* Rows up to which a pair of blocks runs group by group (two streams in flight); from more, one block after the
 * other: a pair's sums of both blocks outgrow the registers. */
#define Q5_PAIR_ROWS 2

/* A pass's activations: row 0's quantized x, scales and corrections (rows K, K / 64 and `corrs` apart; per group
 * the centre, and for Q5_K then the exact sum as a float). */
typedef struct {
    const int8_t *xq;
    const float *xs;
    const int32_t *corr;
    int64_t corrs;
} Q5Rows;

INLINE Q5Rows q5_rows(QuantActs a, int64_t r, int64_t K, int64_t corrs) {
    return (Q5Rows){a.q + r * K, a.s + r * (K / XBLOCK), (const int32_t *)a.corr + r * corrs, corrs};
}

#ifdef LS_AVX512
#define Q5ROWS 8 /* activation rows a pass: an accumulator and a sum each */

/* q with 16 added where bit r of hb's byte is set: the fifth bits (a byte mask, then a masked add). */
INLINE __m512i q5_fifth(__m512i q, __m512i hb, int r) {
    return _mm512_mask_add_epi8(q, _mm512_test_epi8_mask(hb, _mm512_set1_epi8((char)(1 << r))), q,
                                _mm512_set1_epi8(0x10));
}

/* res[i][j] += group g's part of output j of a block for activation row i, the group's bytes at p, its superblock's
 * d and dmin at sd (NULL: Q5_0). Unit c's two vectors of q (16 outputs; columns 8c .. 8c + 3, then 8c + 4 .. 8c + 7)
 * are unpacked and met by every row before the next unit's. */
INLINE void q5_group(Q5Rows x, const uint8_t *p, const float *sd, int64_t K, int64_t g, int mb, __m512 *res) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    int ks = sd != NULL;
    __m512i hb = _mm512_loadu_si512(p + 32), acc[Q5ROWS];
    for (int i = 0; i < mb; i++) acc[i] = _mm512_set1_epi32(x.corr[i * x.corrs + (1 + ks) * g]);
    for (int c = 0; c < Q5_UNITS; c++) {
        __m512i v = _mm512_loadu_si512(p + 96 + 64 * c);
        __m512i lo = q5_fifth(_mm512_and_si512(v, low), hb, 2 * c);
        __m512i hi = q5_fifth(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), hb, 2 * c + 1);
        for (int i = 0; i < mb; i++) {
            const int8_t *xi = x.xq + i * K + 32 * g + 8 * c;
            acc[i] = _mm512_dpbusd_epi32(acc[i], lo, _mm512_set1_epi32(four_bytes(xi)));
            acc[i] = _mm512_dpbusd_epi32(acc[i], hi, _mm512_set1_epi32(four_bytes(xi + 4)));
        }
    }
    __m512 scale, minc = _mm512_setzero_ps();
    if (ks) {
        __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
        __m512 m = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
        scale = _mm512_mul_ps(_mm512_loadu_ps(sd), sc);
        minc = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(16.f), scale), _mm512_mul_ps(_mm512_loadu_ps(sd + 16), m));
    } else {
        scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    }
    for (int i = 0; i < mb; i++) {
        __m512 s = _mm512_mul_ps(scale, _mm512_set1_ps(x.xs[i * (K / XBLOCK) + g / 2]));
        res[i] = _mm512_fmadd_ps(s, _mm512_cvtepi32_ps(acc[i]), res[i]);
        if (ks)
            res[i] = _mm512_fmadd_ps(minc, _mm512_set1_ps(((const float *)x.corr)[i * x.corrs + 2 * g + 1]), res[i]);
    }
}

INLINE void q5_store(const __m512 *res, int mb, float (*out)[16]) {
    for (int i = 0; i < mb; i++) _mm512_storeu_ps(out[i], res[i]);
}

typedef __m512 Q5Sums[Q5ROWS];
#define Q5_ZERO(res) for (int i = 0; i < mb; i++) res[i] = _mm512_setzero_ps()
#else
#define Q5ROWS 4 /* activation rows a pass: the block's two halves of 8 outputs, a sum each */

/* As the AVX-512 q5_fifth on 256 bits: bit r of hb's byte moved to bit 4 and added in. */
INLINE __m256i q5_fifth(__m256i q, __m256i hb, int r) {
    __m256i at4 = r < 4 ? _mm256_slli_epi16(hb, 4 - r) : r > 4 ? _mm256_srli_epi16(hb, r - 4) : hb;
    return _mm256_or_si256(q, _mm256_and_si256(at4, _mm256_set1_epi8(0x10)));
}

/* As the AVX-512 q5_group, each row's 16 outputs as two halves of 8 (res[2 i + h]), a group's halves in turn.
 * Plain AVX2 multiplies with vpmaddubsw: its pairs are at most 2 * 31 * 128 = 7936, two units' four of them 31744 <
 * 32767 in int16: exact, then one vpmaddwd to int32 per two units. */
INLINE void q5_group(Q5Rows x, const uint8_t *p, const float *sd, int64_t K, int64_t g, int mb, __m256 *res) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    int ks = sd != NULL;
    for (int h = 0; h < 2; h++) {
        __m256i hb = _mm256_loadu_si256((const __m256i *)(p + 32 + 32 * h)), acc[Q5ROWS];
#ifndef LS_AVXVNNI
        __m256i pairs[Q5ROWS] = {0}; /* (each even unit sets them first: for the compiler) */
#endif
        for (int i = 0; i < mb; i++) acc[i] = _mm256_set1_epi32(x.corr[i * x.corrs + (1 + ks) * g]);
        for (int c = 0; c < Q5_UNITS; c++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(p + 96 + 64 * c + 32 * h));
            __m256i lo = q5_fifth(_mm256_and_si256(v, low), hb, 2 * c);
            __m256i hi = q5_fifth(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), hb, 2 * c + 1);
            for (int i = 0; i < mb; i++) {
                const int8_t *xi = x.xq + i * K + 32 * g + 8 * c;
                __m256i x0 = _mm256_set1_epi32(four_bytes(xi)), x1 = _mm256_set1_epi32(four_bytes(xi + 4));
#ifdef LS_AVXVNNI
                acc[i] = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc[i], lo, x0), hi, x1);
#else
                __m256i two = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1));
                pairs[i] = c % 2 == 0 ? two : _mm256_add_epi16(pairs[i], two);
                if (c % 2) acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(pairs[i], _mm256_set1_epi16(1)));
#endif
            }
        }
        __m256 scale, minc = _mm256_setzero_ps();
        if (ks) {
            __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * h))));
            __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 16 + 8 * h))));
            scale = _mm256_mul_ps(_mm256_loadu_ps(sd + 8 * h), sc);
            minc = _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(16.f), scale),
                                 _mm256_mul_ps(_mm256_loadu_ps(sd + 16 + 8 * h), m));
        } else {
            scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16 * h)));
        }
        for (int i = 0; i < mb; i++) {
            __m256 s = _mm256_mul_ps(scale, _mm256_set1_ps(x.xs[i * (K / XBLOCK) + g / 2]));
            res[2 * i + h] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(acc[i]), res[2 * i + h]);
            if (ks)
                res[2 * i + h] = _mm256_fmadd_ps(minc, _mm256_set1_ps(((const float *)x.corr)[i * x.corrs + 2 * g + 1]),
                                                 res[2 * i + h]);
        }
    }
}

INLINE void q5_store(const __m256 *res, int mb, float (*out)[16]) {
    for (int i = 0; i < mb; i++) {
        _mm256_storeu_ps(out[i], res[2 * i]);
        _mm256_storeu_ps(out[i] + 8, res[2 * i + 1]);
    }
}

typedef __m256 Q5Sums[2 * Q5ROWS];
#define Q5_ZERO(res) for (int i = 0; i < 2 * mb; i++) res[i] = _mm256_setzero_ps()
#endif

/* Group g of the block at p into res: Q5_0's groups follow one another; Q5_K's come 8 to a superblock after its
 * header (the 16 d, then the 16 dmin). */
INLINE void q5_block_group(Q5Rows x, const uint8_t *p, int ks, int64_t K, int64_t g, int mb, Q5Sums res) {
    if (!ks) {
        q5_group(x, p + g * Q5_GROUP, NULL, K, g, mb, res);
        return;
    }
    const uint8_t *sp = p + g / 8 * Q5K_SUPER;
    q5_group(x, sp + 128 + g % 8 * Q5_GROUP, (const float *)sp, K, g, mb, res);
}

/* out[i][j] = output j of the block at p for activation row i. */
INLINE void q5_block(Q5Rows x, const uint8_t *p, int ks, int64_t K, int mb, float (*out)[16]) {
    Q5Sums res;
    Q5_ZERO(res);
    for (int64_t g = 0; g < K / 32; g++) q5_block_group(x, p, ks, K, g, mb, res);
    q5_store(res, mb, out);
}

/* q5_block of two blocks, p0 with rows x0 (into out) and p1 with rows x1 (into out1), group by group: two streams
 * of weights in flight, each block's arithmetic as it is alone. */
INLINE void q5_block_pair(Q5Rows x0, Q5Rows x1, const uint8_t *p0, const uint8_t *p1, int ks, int64_t K,
                          float (*out1)[16], int mb, float (*out)[16]) {
    Q5Sums res0, res1;
    Q5_ZERO(res0);
    Q5_ZERO(res1);
    for (int64_t g = 0; g < K / 32; g++) {
        q5_block_group(x0, p0, ks, K, g, mb, res0);
        q5_block_group(x1, p1, ks, K, g, mb, res1);
    }
    q5_store(res0, mb, out);
    q5_store(res1, mb, out1);
}

/* The corrections a row holds: per 32 columns the centre (Q5_K: and the exact sum). */
INLINE int64_t q5_corrs(int ks, int64_t K) { return (1 + ks) * (K / 32); }

void q5_block_dots(QuantActs a, int64_t first, int64_t m, const uint8_t *block, int64_t K, int ks, float *dots) {
    for (int64_t m0 = 0; m0 < m; m0 += Q5ROWS) {
        int mb = m - m0 < Q5ROWS ? (int)(m - m0) : Q5ROWS;
        float(*out)[16] = (float(*)[16])(dots + 16 * m0);
        FOR_ROWS_UPTO(Q5ROWS, q5_block, q5_rows(a, first + m0, K, q5_corrs(ks, K)), block, ks, K)
    }
}

void q5_block_pair_dots(QuantActs a0, int64_t first0, QuantActs a1, int64_t first1, int64_t m, const uint8_t *block0,
                        const uint8_t *block1, int64_t K, int ks, float *dots0, float *dots1) {
    if (m > Q5_PAIR_ROWS) {
        q5_block_dots(a0, first0, m, block0, K, ks, dots0);
        q5_block_dots(a1, first1, m, block1, K, ks, dots1);
        return;
    }
    for (int64_t m0 = 0; m0 < m; m0 += Q5ROWS) {
        int mb = m - m0 < Q5ROWS ? (int)(m - m0) : Q5ROWS;
        float(*out)[16] = (float(*)[16])(dots0 + 16 * m0), (*out1)[16] = (float(*)[16])(dots1 + 16 * m0);
        FOR_ROWS_UPTO(Q5ROWS, q5_block_pair, q5_rows(a0, first0 + m0, K, q5_corrs(ks, K)),
                      q5_rows(a1, first1 + m0, K, q5_corrs(ks, K)), block0, block1, ks, K, out1)
    }
}
