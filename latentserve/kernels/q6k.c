/* Q6_K weights (`pack_q6k`; quant_blocks.c and experts.c drive them): y[M, N] = x[M, K] @ w[N, K]^T with llama.cpp's
 * 6-bit k-quant values exactly, w = d * sc * (q - 32): per 256 columns an fp32 d an output (the file's fp16), per
 * 16 columns an int8 sc, q in [0, 63]. K % 256 == 0.
 *
 * Why its own layout and not int4's with more bits: int4 keeps a (scale, minimum) bf16 pair an output and group,
 * 2 bits a weight at Q6_K's groups of 16, so a Q6_K tensor would read 8 bits a weight, as many as int8 (and lose the
 * file's values to bf16). Here it reads 6.625 (Q6_K itself 6.5625), and d * sc is exact in fp32 (11 by 8 bits).
 *
 * Layout: the outputs in blocks of 16 (N padded with zero rows), each block one stream of bytes; per 256 columns
 * (a super-block, Q6K_SUPER bytes) the 16 outputs' d (64 bytes of fp32), their sc (16 groups of 16 bytes, group-major),
 * then per group of 16 columns three 64-byte units: unit u (u < 3) byte 4j + i = q[j, 4u + i] | 2 bits of
 * q[j, 12 + i] << 6 (its bits 2u, 2u + 1). Columns 0-11 come out with one AND a vector, 12-15 from the three units'
 * top bits; as nibble planes (int4's units and a plane of high bit pairs) the unpacking took 13 operations a group on
 * AVX-512 (AVX2: 17 a half) where this takes 9 (11), which bound the AVX2 build at one row. One 64-byte load feeds
 * all 16 outputs against 4 columns of x broadcast to every lane, as int4's.
 *
 * The activations are int4's (int8 per 64 columns, quant_acts.c), with per 16 columns -32 * the sum of their
 * quantized x (`corr`, as int32): a group's integer sum starts there, so that it is the sum of (q - 32) * xq with
 * q as vpdpbusd's unsigned operand. Per group the sum times d * sc goes into a row's float sum of its 64 columns
 * (t), which is scaled by x's scale once per 64 columns. Same operations in the same order on every build: the same
 * bits on AVX2 and AVX-512. */
#include "q6k.h"

/* From this many rows the sums bind and the hardware prefetchers fall behind: each group then fetches its lines of the
 * block read next (`ahead` bytes on: the next one in memory) into L2, as int8's fetch_next. lm_head (102400 x 2048)
 * on Zen 4, 2 threads, against int8 in turns: 4 rows 0.62x -> 1.14x, 8 rows 0.46x -> 0.91x; fetching at 2 rows
 * slowed them (1.19x -> 1.09x). */
#define Q6K_FETCH_ROWS 3

/* The lines of `bytes` at p of the block read next, fetched into L2 from Q6K_FETCH_ROWS rows; at fewer, those
 * read_ahead bytes on into L1 (fetch_ahead, int4's: on Intel). */
INLINE void q6k_fetch(const uint8_t *p, int64_t ahead, int64_t bytes, int mb) {
    if (mb < Q6K_FETCH_ROWS) return fetch_ahead(p, bytes);
    for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch((const char *)((uintptr_t)p + ahead + l), _MM_HINT_T1);
}

#ifdef LS_AVX512
#define Q6ROWS 8 /* activation rows a pass: 2 vector registers each */

/* res[i][j] += super-block s's part of output j of a block for activation row i (xq, xs, cen: row 0's; rows K, K / 64,
 * K / 16 apart), its bytes at p. */
INLINE void q6k_super(const int8_t *xq, const float *xs, const int32_t *cen, const uint8_t *p, int64_t ahead,
                      int64_t K, int64_t s, int mb, __m512 *res) {
    q6k_fetch(p, ahead, 64 + 16 * Q6K_GROUPS, mb);
    __m512 t[Q6ROWS];
    const float *sd = (const float *)p;
    const int8_t *sc = (const int8_t *)p + 64;
    p += 64 + 16 * Q6K_GROUPS;
    for (int g = 0; g < Q6K_GROUPS; g++, p += 192) {
        int64_t c = 256 * s + 16 * g;
        q6k_fetch(p, ahead, 192, mb);
        __m512 scale = q6k_scale(sd, sc, g);
        __m512i q[4];
        q6k_unpack(p, q);
        for (int i = 0; i < mb; i++) {
            const int8_t *x = xq + i * K + c;
            __m512i acc = _mm512_set1_epi32(cen[i * (K / 16) + c / 16]);
            for (int r = 0; r < 4; r++) acc = _mm512_dpbusd_epi32(acc, q[r], _mm512_set1_epi32(four_bytes(x + 4 * r)));
            t[i] = g % 4 == 0 ? _mm512_mul_ps(scale, _mm512_cvtepi32_ps(acc))
                              : _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(acc), t[i]);
            if (g % 4 == 3) res[i] = _mm512_fmadd_ps(_mm512_set1_ps(xs[i * (K / XBLOCK) + c / XBLOCK]), t[i], res[i]);
        }
    }
}

INLINE void q6k_store(const __m512 *res, int mb, float (*out)[16]) {
    for (int i = 0; i < mb; i++) _mm512_storeu_ps(out[i], res[i]);
}

typedef __m512 Q6Sums[Q6ROWS];
#define Q6K_ZERO(res) for (int i = 0; i < mb; i++) res[i] = _mm512_setzero_ps()
#else
#define Q6ROWS 2    /* activation rows a pass of q6k_super: the block's two halves of 8 outputs, 2 registers each */
#define Q6K_HROWS 4 /* rows a pass of q6k_halves: one half at a time, 2 registers a row */
#define Q6K_HALVES_FROM 3 /* rows from which a block (a pair: each of its blocks) runs q6k_halves */

/* The 4 vectors of q of half h (outputs 8h .. 8h + 7) of the group at p (as the AVX-512 q6k_unpack). */
INLINE void q6k_unpack(const uint8_t *p, int h, __m256i q[4]) {
    const __m256i six = _mm256_set1_epi8(0x3f);
    p += 32 * h;
    __m256i a = _mm256_loadu_si256((const __m256i *)p), b = _mm256_loadu_si256((const __m256i *)(p + 64));
    __m256i c = _mm256_loadu_si256((const __m256i *)(p + 128));
    q[0] = _mm256_and_si256(a, six);
    q[1] = _mm256_and_si256(b, six);
    q[2] = _mm256_and_si256(c, six);
    q[3] = _mm256_or_si256(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 6), _mm256_set1_epi8(0x03)),
                                           _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi8(0x0c))),
                           _mm256_and_si256(_mm256_srli_epi16(c, 2), _mm256_set1_epi8(0x30)));
}

/* acc + the products of q[2r], q[2r + 1] with x's columns 8r .. 8r + 7. Plain AVX2: vpmaddubsw's pairs are at most
 * 2 * 63 * 127 = 16002, two of them 32004 < 32767 in int16: exact, then one vpmaddwd to int32. */
INLINE __m256i q6k_step(__m256i acc, const __m256i *q, const int8_t *x) {
    __m256i x0 = _mm256_set1_epi32(four_bytes(x)), x1 = _mm256_set1_epi32(four_bytes(x + 4));
#ifdef LS_AVXVNNI
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc, q[0], x0), q[1], x1);
#else
    __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(q[0], x0), _mm256_maddubs_epi16(q[1], x1));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

/* Group g (at p, column c) of half h for rows i < mb: t[i] and res[i] as the AVX-512 q6k_super's, `stride` registers
 * apart (the super-block's d and sc at d, sc). */
INLINE void q6k_half_group(const int8_t *xq, const float *xs, const int32_t *cen, const float *d, const int8_t *sc,
                           const uint8_t *p, int64_t K, int64_t c, int g, int h, int mb, int stride, __m256 *t,
                           __m256 *res) {
    __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(d + 8 * h), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                     _mm_loadl_epi64((const __m128i *)(sc + 16 * g + 8 * h)))));
    __m256i q[4];
    q6k_unpack(p, h, q);
    for (int i = 0; i < mb; i++) {
        const int8_t *x = xq + i * K + c;
        __m256i acc = q6k_step(q6k_step(_mm256_set1_epi32(cen[i * (K / 16) + c / 16]), q, x), q + 2, x + 8);
        __m256 *ti = t + stride * i;
        *ti = g % 4 == 0 ? _mm256_mul_ps(scale, _mm256_cvtepi32_ps(acc))
                         : _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(acc), *ti);
        if (g % 4 == 3)
            res[stride * i] = _mm256_fmadd_ps(_mm256_set1_ps(xs[i * (K / XBLOCK) + c / XBLOCK]), *ti, res[stride * i]);
    }
}

/* As the AVX-512 q6k_super, each row's 16 outputs as two halves of 8 (res[2 i + h]), a group's halves in turn. */
INLINE void q6k_super(const int8_t *xq, const float *xs, const int32_t *cen, const uint8_t *p, int64_t ahead,
                      int64_t K, int64_t s, int mb, __m256 *res) {
    q6k_fetch(p, ahead, 64 + 16 * Q6K_GROUPS, mb);
    const float *d = (const float *)p;
    const int8_t *sc = (const int8_t *)p + 64;
    __m256 t[2 * Q6ROWS];
    p += 64 + 16 * Q6K_GROUPS;
    for (int g = 0; g < Q6K_GROUPS; g++, p += 192) {
        q6k_fetch(p, ahead, 192, mb);
        for (int h = 0; h < 2; h++)
            q6k_half_group(xq, xs, cen, d, sc, p, K, 256 * s + 16 * g, g, h, mb, 2, t + h, res + h);
    }
}

/* q6k_block for more rows: the block's half h = 0, then h = 1, each over all its super-blocks with one register of
 * sums a row (q6k_super keeps both halves': 4 registers a row, 2 rows a pass), so Q6K_HROWS rows share each unpacked
 * half-group; the first half fetches the next block. The same operations on each output in the same order: the same
 * bits. lm_head (102400 x 2048) on Zen 4 capped to AVX2, 2 threads, against int8 in turns: 8 rows 0.76x -> 0.96x,
 * 32 rows 0.84x; 4 rows 0.77x -> 0.95-1.3x. */
INLINE void q6k_halves(const int8_t *xq, const float *xs, const int32_t *cen, const uint8_t *p, int64_t K, int mb,
                       float (*out)[16]) {
    for (int h = 0; h < 2; h++) {
        __m256 res[Q6K_HROWS], t[Q6K_HROWS];
        for (int i = 0; i < mb; i++) res[i] = _mm256_setzero_ps();
        for (int64_t s = 0; s < K / 256; s++) {
            const uint8_t *sp = p + s * Q6K_SUPER;
            const float *d = (const float *)sp;
            const int8_t *sc = (const int8_t *)sp + 64;
            if (h == 0) q6k_fetch(sp, K / 256 * Q6K_SUPER, 64 + 16 * Q6K_GROUPS, mb);
            for (int g = 0; g < Q6K_GROUPS; g++) {
                const uint8_t *gp = sp + 64 + 16 * Q6K_GROUPS + 192 * g;
                if (h == 0) q6k_fetch(gp, K / 256 * Q6K_SUPER, 192, mb);
                q6k_half_group(xq, xs, cen, d, sc, gp, K, 256 * s + 16 * g, g, h, mb, 1, t, res);
            }
        }
        for (int i = 0; i < mb; i++) _mm256_storeu_ps(out[i] + 8 * h, res[i]);
    }
}

INLINE void q6k_store(const __m256 *res, int mb, float (*out)[16]) {
    for (int i = 0; i < mb; i++) {
        _mm256_storeu_ps(out[i], res[2 * i]);
        _mm256_storeu_ps(out[i] + 8, res[2 * i + 1]);
    }
}

typedef __m256 Q6Sums[2 * Q6ROWS];
#define Q6K_ZERO(res) for (int i = 0; i < 2 * mb; i++) res[i] = _mm256_setzero_ps()
#endif

/* out[i][j] = output j of the block at p for activation row i (xq, xs, cen: row 0's). */
INLINE void q6k_block(const int8_t *xq, const float *xs, const int32_t *cen, const uint8_t *p, int64_t K, int mb,
                      float (*out)[16]) {
    Q6Sums res;
    Q6K_ZERO(res);
    for (int64_t s = 0; s < K / 256; s++) q6k_super(xq, xs, cen, p + s * Q6K_SUPER, K / 256 * Q6K_SUPER, K, s, mb, res);
    q6k_store(res, mb, out);
}

/* q6k_block of two blocks, p0 with rows x0 (into out) and p1 with rows x1 (into out1), super-block by super-block:
 * two streams of weights in flight, each block's arithmetic as it is alone. */
INLINE void q6k_block_pair(const int8_t *x0, const float *xs0, const int32_t *cen0, const int8_t *x1,
                           const float *xs1, const int32_t *cen1, const uint8_t *p0, const uint8_t *p1, int64_t K,
                           float (*out1)[16], int mb, float (*out)[16]) {
    Q6Sums res0, res1;
    Q6K_ZERO(res0);
    Q6K_ZERO(res1);
    for (int64_t s = 0; s < K / 256; s++) {
        q6k_super(x0, xs0, cen0, p0 + s * Q6K_SUPER, K / 256 * Q6K_SUPER, K, s, mb, res0);
        q6k_super(x1, xs1, cen1, p1 + s * Q6K_SUPER, K / 256 * Q6K_SUPER, K, s, mb, res1);
    }
    q6k_store(res0, mb, out);
    q6k_store(res1, mb, out1);
}

/* Row r of a's quantized rows, scales and centres. */
#define Q6K_ROW(a, r, K) (a).q + (r) * (K), (a).s + (r) * ((K) / XBLOCK), (const int32_t *)(a).corr + (r) * ((K) / 16)

void q6k_block_dots(QuantActs a, int64_t first, int64_t m, const uint8_t *block, int64_t K, float *dots) {
#ifdef LS_AMX
    if (m >= AMX_Q6K_ROWS) { /* the rows' whole 16s on tiles, the rest here (as q45_block_dots) */
        int64_t tiles = m & ~(int64_t)15;
        amx_q6k_block_dots(a, first, tiles, block, K, dots);
        first += tiles, m -= tiles, dots += 16 * tiles;
    }
#endif
#ifndef LS_AVX512
    if (m >= Q6K_HALVES_FROM) {
        for (int64_t m0 = 0; m0 < m; m0 += Q6K_HROWS) {
            int mb = m - m0 < Q6K_HROWS ? (int)(m - m0) : Q6K_HROWS;
            float(*out)[16] = (float(*)[16])(dots + 16 * m0);
            FOR_ROWS_UPTO(Q6K_HROWS, q6k_halves, Q6K_ROW(a, first + m0, K), block, K)
        }
        return;
    }
#endif
    for (int64_t m0 = 0; m0 < m; m0 += Q6ROWS) {
        int mb = m - m0 < Q6ROWS ? (int)(m - m0) : Q6ROWS;
        float(*out)[16] = (float(*)[16])(dots + 16 * m0);
        FOR_ROWS_UPTO(Q6ROWS, q6k_block, Q6K_ROW(a, first + m0, K), block, K)
    }
}

void q6k_block_pair_dots(QuantActs a0, int64_t first0, QuantActs a1, int64_t first1, int64_t m, const uint8_t *block0,
                         const uint8_t *block1, int64_t K, float *dots0, float *dots1) {
#ifndef LS_AVX512
    if (m >= Q6K_HALVES_FROM) {
        q6k_block_dots(a0, first0, m, block0, K, dots0);
        q6k_block_dots(a1, first1, m, block1, K, dots1);
        return;
    }
#endif
    for (int64_t m0 = 0; m0 < m; m0 += Q6ROWS) {
        int mb = m - m0 < Q6ROWS ? (int)(m - m0) : Q6ROWS;
        float(*out)[16] = (float(*)[16])(dots0 + 16 * m0), (*out1)[16] = (float(*)[16])(dots1 + 16 * m0);
        FOR_ROWS_UPTO(Q6ROWS, q6k_block_pair, Q6K_ROW(a0, first0 + m0, K), Q6K_ROW(a1, first1 + m0, K), block0, block1,
                      K, out1)
    }
}
