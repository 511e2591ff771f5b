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
 * The activations are Q6_K's (int8 per 64 columns, quant_acts.c, with per 16 columns -32 * the sum of their
 * quantized x as int32): half of two such sums, -16 * the sum over 32 columns, starts a group's integer sum, so that
 * it is the sum of (q - 16) * xq with q as the unsigned operand of vpdpbusd (AVX2: vpmaddubsw). Per group the sum
 * times d goes into a row's float sum of its 64 columns (t), which is scaled by x's scale once per 64 columns. Same
 * operations in the same order on every build: the same bits on AVX2 and AVX-512. */
#include "quant.h"

#define Q50_UNITS 4 /* 64-byte units of nibbles a group: 8 columns each */

/* Row r of a's quantized rows, scales and centres (quant_acts.c: Q6_K's, per 16 columns). */
#define Q50_ROW(a, r, K) (a).q + (r) * (K), (a).s + (r) * ((K) / XBLOCK), (const int32_t *)(a).corr + (r) * ((K) / 16)

/* The integer sum's start for the group at column c: -16 * the sum of 32 quantized x, from two sums of 16 times -32
 * (their sum is a multiple of 32: halving is exact). */
INLINE int32_t q50_centre(const int32_t *cen, int64_t c) { return (cen[c / 16] + cen[c / 16 + 1]) / 2; }

#ifdef LS_AVX512
#define Q50ROWS 8 /* activation rows a pass: 2 vector registers each */

/* Bit r of every byte of hb moved to bit 4, the rest cleared. */
INLINE __m512i q50_fifth(__m512i hb, int r) {
    __m512i at4 = r < 4 ? _mm512_slli_epi16(hb, 4 - r) : r > 4 ? _mm512_srli_epi16(hb, r - 4) : hb;
    return _mm512_and_si512(at4, _mm512_set1_epi8(0x10));
}

/* The 8 vectors of q (16 outputs; columns 8c .. 8c + 3 in q[2c], 8c + 4 .. 8c + 7 in q[2c + 1]) of the group at p. */
INLINE void q50_unpack(const uint8_t *p, __m512i q[2 * Q50_UNITS]) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512i hb = _mm512_loadu_si512(p + 32);
    for (int c = 0; c < Q50_UNITS; c++) {
        __m512i v = _mm512_loadu_si512(p + 96 + 64 * c);
        q[2 * c] = _mm512_or_si512(_mm512_and_si512(v, low), q50_fifth(hb, 2 * c));
        q[2 * c + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), q50_fifth(hb, 2 * c + 1));
    }
}

/* res[i][j] += group g's part of output j of a block for activation row i (xq, xs, cen: row 0's; rows K, K / 64,
 * K / 16 apart), its bytes at p; t[i] holds the float sum of the group's 64 columns. */
INLINE void q50_group(const int8_t *xq, const float *xs, const int32_t *cen, const uint8_t *p, int64_t K, int64_t g,
                      int mb, __m512 *t, __m512 *res) {
    int64_t c = 32 * g;
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    __m512i q[2 * Q50_UNITS];
    q50_unpack(p, q);
    for (int i = 0; i < mb; i++) {
        const int8_t *x = xq + i * K + c;
        __m512i acc = _mm512_set1_epi32(q50_centre(cen + i * (K / 16), c));
        for (int r = 0; r < 2 * Q50_UNITS; r++)
            acc = _mm512_dpbusd_epi32(acc, q[r], _mm512_set1_epi32(four_bytes(x + 4 * r)));
        t[i] = g % 2 == 0 ? _mm512_mul_ps(d, _mm512_cvtepi32_ps(acc)) : _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(acc), t[i]);
        if (g % 2) res[i] = _mm512_fmadd_ps(_mm512_set1_ps(xs[i * (K / XBLOCK) + c / XBLOCK]), t[i], res[i]);
    }
}

INLINE void q50_store(const __m512 *res, int mb, float (*out)[16]) {
    for (int i = 0; i < mb; i++) _mm512_storeu_ps(out[i], res[i]);
}

typedef __m512 Q50Sums[Q50ROWS];
#define Q50_ZERO(res) for (int i = 0; i < mb; i++) res[i] = _mm512_setzero_ps()
#else
#define Q50ROWS 2 /* activation rows a pass: the block's two halves of 8 outputs, 2 registers each */

/* As the AVX-512 q50_fifth on 256 bits. */
INLINE __m256i q50_fifth(__m256i hb, int r) {
    __m256i at4 = r < 4 ? _mm256_slli_epi16(hb, 4 - r) : r > 4 ? _mm256_srli_epi16(hb, r - 4) : hb;
    return _mm256_and_si256(at4, _mm256_set1_epi8(0x10));
}

/* The 8 vectors of q of half h (outputs 8h .. 8h + 7) of the group at p (as the AVX-512 q50_unpack). */
INLINE void q50_unpack(const uint8_t *p, int h, __m256i q[2 * Q50_UNITS]) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256i hb = _mm256_loadu_si256((const __m256i *)(p + 32 + 32 * h));
    for (int c = 0; c < Q50_UNITS; c++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(p + 96 + 64 * c + 32 * h));
        q[2 * c] = _mm256_or_si256(_mm256_and_si256(v, low), q50_fifth(hb, 2 * c));
        q[2 * c + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), q50_fifth(hb, 2 * c + 1));
    }
}

/* acc + the products of q[0..4) with x's 16 columns. Plain AVX2: vpmaddubsw's pairs are at most 2 * 31 * 128 = 7936,
 * four of them 31744 < 32767 in int16: exact, then one vpmaddwd to int32. */
INLINE __m256i q50_step(__m256i acc, const __m256i *q, const int8_t *x) {
#ifdef LS_AVXVNNI
    for (int r = 0; r < 4; r++) acc = _mm256_dpbusd_avx_epi32(acc, q[r], _mm256_set1_epi32(four_bytes(x + 4 * r)));
    return acc;
#else
    __m256i pairs = _mm256_maddubs_epi16(q[0], _mm256_set1_epi32(four_bytes(x)));
    for (int r = 1; r < 4; r++)
        pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(q[r], _mm256_set1_epi32(four_bytes(x + 4 * r))));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

/* As the AVX-512 q50_group, each row's 16 outputs as two halves of 8 (t[2 i + h], res[2 i + h]), a group's halves in
 * turn. */
INLINE void q50_group(const int8_t *xq, const float *xs, const int32_t *cen, const uint8_t *p, int64_t K, int64_t g,
                      int mb, __m256 *t, __m256 *res) {
    int64_t c = 32 * g;
    for (int h = 0; h < 2; h++) {
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16 * h)));
        __m256i q[2 * Q50_UNITS];
        q50_unpack(p, h, q);
        for (int i = 0; i < mb; i++) {
            const int8_t *x = xq + i * K + c;
            __m256i acc = q50_step(q50_step(_mm256_set1_epi32(q50_centre(cen + i * (K / 16), c)), q, x), q + 4, x + 16);
            __m256 *ti = t + 2 * i + h;
            *ti = g % 2 == 0 ? _mm256_mul_ps(d, _mm256_cvtepi32_ps(acc)) : _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(acc), *ti);
            if (g % 2)
                res[2 * i + h] = _mm256_fmadd_ps(_mm256_set1_ps(xs[i * (K / XBLOCK) + c / XBLOCK]), *ti, res[2 * i + h]);
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
    Q50Sums res, t;
    Q50_ZERO(res);
    Q50_ZERO(t); /* (each even group sets it first: for the compiler) */
    for (int64_t g = 0; g < K / 32; g++) q50_group(xq, xs, cen, p + g * Q50_GROUP, K, g, mb, t, res);
    q50_store(res, mb, out);
}

/* q50_block of two blocks, p0 with rows x0 (into out) and p1 with rows x1 (into out1), group by group: two streams
 * of weights in flight, each block's arithmetic as it is alone. */
INLINE void q50_block_pair(const int8_t *x0, const float *xs0, const int32_t *cen0, const int8_t *x1,
                           const float *xs1, const int32_t *cen1, const uint8_t *p0, const uint8_t *p1, int64_t K,
                           float (*out1)[16], int mb, float (*out)[16]) {
    Q50Sums res0, res1, t0, t1;
    Q50_ZERO(res0);
    Q50_ZERO(res1);
    Q50_ZERO(t0);
    Q50_ZERO(t1);
    for (int64_t g = 0; g < K / 32; g++) {
        q50_group(x0, xs0, cen0, p0 + g * Q50_GROUP, K, g, mb, t0, res0);
        q50_group(x1, xs1, cen1, p1 + g * Q50_GROUP, K, g, mb, t1, res1);
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
    for (int64_t m0 = 0; m0 < m; m0 += Q50ROWS) {
        int mb = m - m0 < Q50ROWS ? (int)(m - m0) : Q50ROWS;
        float(*out)[16] = (float(*)[16])(dots0 + 16 * m0), (*out1)[16] = (float(*)[16])(dots1 + 16 * m0);
        FOR_ROWS_UPTO(Q50ROWS, q50_block_pair, Q50_ROW(a0, first0 + m0, K), Q50_ROW(a1, first1 + m0, K), block0, block1,
                      K, out1)
    }
}
