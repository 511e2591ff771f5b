/* The avx2_vnni build's int8 sums (AVX-VNNI: vpdpbusd on AVX2's 256-bit registers), included by qgemm.c in place of
 * int8_nibbles.h: the same names (int8_rows, lanes_span), from which qgemm.c's AVX2 lanes_sums and
 * lanes_sums_pair are made (after its fetch_next and fetch_near). The activations are whole bytes u = x + 128 (quant.h
 * int8_row_bytes), as on AVX-512: one vpdpbusd takes 32 products into int32 lanes where plain AVX2 spends two
 * vpmaddubsw, two int16 additions and a share of the widening on the nibbles. The integer sums are the other builds',
 * so the outputs are too. */
#pragma once

#include "quant.h"

INLINE __m256i dpbusd(__m256i acc, __m256i u, __m256i w) { return _mm256_dpbusd_avx_epi32(acc, u, w); }

/* dot[i] = sum_k (x[i, k] + 128) * w[k] over mb rows of u (xstride bytes apart): 32 columns a step. */
INLINE void int8_rows(const int8_t *xq, int64_t xstride, const int8_t *w, int64_t K, int mb, int32_t dot[MB]) {
    __m256i acc[MB];
    for (int i = 0; i < mb; i++) acc[i] = _mm256_setzero_si256();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m256i wv = _mm256_loadu_si256((const __m256i *)(w + k));
        for (int i = 0; i < mb; i++)
            acc[i] = dpbusd(acc[i], _mm256_loadu_si256((const __m256i *)(xq + i * xstride + k)), wv);
    }
    for (int i = 0; i < mb; i++) {
        int32_t d = hsum_epi32(acc[i]);
        for (int64_t t = k; t < K; t++) d += (uint8_t)xq[i * xstride + t] * w[t];
        dot[i] = d;
    }
}

/* acc[i][h] (h: the unit's halves of 8 outputs) += the sums of units [c, end) of w for rows i < mb of u (x, xstride
 * apart), unit by unit: the weight's two vectors feed every row. ahead: each unit of the next block fetched into L2
 * (fetch_next); near: the line read_ahead bytes on into L1 (fetch_near). */
INLINE void lanes_span(const uint8_t *x, int64_t xstride, const int8_t *w, int64_t c, int64_t end, int64_t ahead,
                       int near, int mb, __m256i (*acc)[2]) {
    __m256i sum[MB][2]; /* in registers for the span (acc may live in memory) */
    for (int i = 0; i < mb; i++) sum[i][0] = acc[i][0], sum[i][1] = acc[i][1];
    for (; c < end; c++) {
        fetch_next(w, c, ahead, mb);
        if (near) fetch_near(w + 64 * c);
        __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + 64 * c));
        __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + 64 * c + 32));
        for (int i = 0; i < mb; i++) {
            __m256i u = _mm256_set1_epi32(four_bytes((const int8_t *)x + i * xstride + 4 * c));
            sum[i][0] = dpbusd(sum[i][0], u, w0);
            sum[i][1] = dpbusd(sum[i][1], u, w1);
        }
    }
    for (int i = 0; i < mb; i++) acc[i][0] = sum[i][0], acc[i][1] = sum[i][1];
}
