/* The AVX2 build's int8 sums on the activations' nibbles (quant.h int8_row_bytes), included by qgemm.c: the rows
 * layout's int8_rows and the lanes layout's lanes_span, from which qgemm.c's lanes_sums and lanes_sums_pair are made
 * (after its fetch_near). The avx2_vnni build's: int8_vnni256.h. */
#pragma once

#include "quant.h"

/* The AVX2 sums, on the activations' nibbles (quant.h int8_row_bytes): vpmaddubsw of each nibble (unsigned, at most
 * 15) with the weights (signed, -128 allowed) gives pairs of products of at most 2 * 15 * 128 = 3840, so
 * NIBBLE_STEPS of them add up in int16 before one vpmaddwd widens them (by 16 for the high nibbles, by 1 for the
 * low). Per row and 32 bytes of weights that is two vpmaddubsw and two vpaddw, against vpsignb, vpmaddubsw, vpmaddwd
 * and vpaddd (u8 |w| times x with w's sign) before: the same count, but half of it is additions, which a third vector
 * port takes, where the multiplier ports took three of four (benchmarks/RESULTS.md "int8 on AVX2: nibbles"). */
#define NIBBLE_STEPS 8

/* hi, lo (the int16 sums of a row's steps) += the products of the broadcast or loaded nibbles with wv; first: they
 * start there. The empty asm keeps each sum a chain: GCC otherwise reassociates the steps into a tree of products
 * spilled to the stack. */
INLINE void nibble_step(__m256i x_hi, __m256i x_lo, __m256i wv, int first, __m256i *hi, __m256i *lo) {
    __m256i ph = _mm256_maddubs_epi16(x_hi, wv), pl = _mm256_maddubs_epi16(x_lo, wv);
    *hi = first ? ph : _mm256_add_epi16(*hi, ph);
    *lo = first ? pl : _mm256_add_epi16(*lo, pl);
    __asm__("" : "+x"(*hi), "+x"(*lo));
}

/* acc (int32) + 16 hi + lo, pairs of int16 lanes added. */
INLINE __m256i nibble_widen(__m256i acc, __m256i hi, __m256i lo) {
    __m256i sums = _mm256_add_epi32(_mm256_madd_epi16(hi, _mm256_set1_epi16(16)),
                                    _mm256_madd_epi16(lo, _mm256_set1_epi16(1)));
    return _mm256_add_epi32(acc, sums);
}

/* dot[i] = sum_k (x[i, k] + 128) * w[k] over mb rows of nibbles (xstride bytes apart): 32 columns a step. */
INLINE void int8_rows(const int8_t *xq, int64_t xstride, const int8_t *w, int64_t K, int mb, int32_t dot[MB]) {
    const uint8_t *x = (const uint8_t *)xq;
    __m256i acc[MB];
    for (int i = 0; i < mb; i++) acc[i] = _mm256_setzero_si256();
    int64_t k = 0;
    while (k + 32 <= K) {
        __m256i hi[MB], lo[MB];
        for (int i = 0; i < mb; i++) hi[i] = lo[i] = _mm256_setzero_si256();
        for (int step = 0; step < NIBBLE_STEPS && k + 32 <= K; step++, k += 32) {
            __m256i wv = _mm256_loadu_si256((const __m256i *)(w + k));
            for (int i = 0; i < mb; i++) {
                const uint8_t *p = x + i * xstride + 2 * k;
                nibble_step(_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)(p + 32)), wv,
                            0, &hi[i], &lo[i]);
            }
        }
        for (int i = 0; i < mb; i++) acc[i] = nibble_widen(acc[i], hi[i], lo[i]);
    }
    for (int i = 0; i < mb; i++) {
        int32_t d = hsum_epi32(acc[i]);
        for (int64_t t = k; t < K; t++) d += (16 * x[i * xstride + k + t] + x[i * xstride + k + t + 32]) * w[t];
        dot[i] = d;
    }
}

/* Rows a pass of the AVX2 lanes kernels (of MB a pass of the callers'): their four int16 sums each, the unit's two
 * weight vectors and the broadcasts fill the 16 registers; 3 rows spilled (0.95-0.98x). */
#define NIBBLE_ROWS 2

/* Unit u of a group (x, w at the group's first): hi, lo [i][h] (h: the unit's halves of 8 outputs) as nibble_step
 * for rows i < rows of nibbles x, xstride apart. ahead: unit u of the next block fetched into L2 (fetch_next); near:
 * the line read_ahead bytes on into L1 (fetch_near). */
INLINE void lanes_unit(const uint8_t *x, int64_t xstride, const int8_t *w, int u, int64_t ahead, int near, int rows,
                       __m256i (*hi)[2], __m256i (*lo)[2]) {
    if (ahead) _mm_prefetch((const char *)((uintptr_t)w + 64 * u + ahead), _MM_HINT_T1);
    if (near) fetch_near(w + 64 * u);
    __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + 64 * u));
    __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + 64 * u + 32));
    for (int i = 0; i < rows; i++) {
        __m256i x_hi = _mm256_set1_epi32(four_bytes((const int8_t *)x + i * xstride + 4 * u));
        __m256i x_lo = _mm256_set1_epi32(four_bytes((const int8_t *)x + i * xstride + 32 + 4 * u));
        nibble_step(x_hi, x_lo, w0, u == 0, &hi[i][0], &lo[i][0]);
        nibble_step(x_hi, x_lo, w1, u == 0, &hi[i][1], &lo[i][1]);
    }
}

/* acc[i][h] += the sums of units 0 < n <= NIBBLE_STEPS of a group (lanes_unit's). */
INLINE void lanes_group(const uint8_t *x, int64_t xstride, const int8_t *w, int n, int64_t ahead, int near, int rows,
                        __m256i (*acc)[2]) {
    __m256i hi[NIBBLE_ROWS][2], lo[NIBBLE_ROWS][2];
    lanes_unit(x, xstride, w, 0, ahead, near, rows, hi, lo);
#pragma GCC unroll 8
    for (int u = 1; u < n; u++) lanes_unit(x, xstride, w, u, ahead, near, rows, hi, lo);
    for (int i = 0; i < rows; i++)
        for (int h = 0; h < 2; h++) acc[i][h] = nibble_widen(acc[i][h], hi[i][h], lo[i][h]);
}

/* lanes_group of units [c, end) of w (c a multiple of NIBBLE_STEPS: x's groups of 32 columns) for mb rows,
 * NIBBLE_ROWS at a time group by group: the group's weights are read from L1 by the later rows and the reads from
 * memory keep an even pace (the rows in turns over whole 2 KB turns measured 0.89-0.92x at 4 rows). The first rows
 * fetch. */
INLINE void lanes_span(const uint8_t *x, int64_t xstride, const int8_t *w, int64_t c, int64_t end, int64_t ahead,
                       int near, int mb, __m256i (*acc)[2]) {
    for (; c < end; c += NIBBLE_STEPS)
        for (int i0 = 0; i0 < mb; i0 += NIBBLE_ROWS) {
            int rows = mb - i0 < NIBBLE_ROWS ? mb - i0 : NIBBLE_ROWS;
            const uint8_t *xg = x + i0 * xstride + 8 * c;
            int64_t fetch = i0 == 0 ? ahead : 0;
            if (c + NIBBLE_STEPS <= end)
                lanes_group(xg, xstride, w + 64 * c, NIBBLE_STEPS, fetch, near && i0 == 0, rows, acc + i0);
            else
                lanes_group(xg, xstride, w + 64 * c, (int)(end - c), fetch, near && i0 == 0, rows, acc + i0);
        }
}
