/* The fp32 tiles of MLA's absorbed decode attention (mla_decode.c): a tile's rows scored against an item's scaled
 * fp32 queries, a head a vector, the online softmax over the scores, the rows weighed into the accumulators, for
 * fp32 and bf16 rows, and one item of an fp32 or bf16 cache walked tile by tile (decode_item). bf16 queries under
 * AVX512-BF16 take mla_lanes.h's tiles instead. mla_decode.c drives them: items, chunks, the quantized caches'
 * items, the combination. */
#pragma once

#include "kv_rows.h"

#define HEADS 8       /* heads per item at most: their accumulators stay in registers */
#define ROW_TILE 64   /* positions per tile: scored, then weighed while in cache (even: bf16 pairs positions) */
#define CHUNK 256     /* positions per item (a multiple of ROW_TILE) */

/* Rows lie in blocks scattered over the cache, where the hardware's prefetchers lose the stream at every block:
 * the score pass asks for the row this many positions ahead. */
#define PREFETCH_ROWS 4

INLINE void prefetch_row(const char *const *rows, int64_t p, int64_t n, int64_t bytes) {
    if (p < n)
        for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(rows[p] + b, _MM_HINT_T0);
}

/* s[h] = the sum of acc[h]'s lanes for h < nh (acc[h] zero from nh on): under AVX-512 one tree for all 8 heads
 * (a reduction per head costs as much as a quarter of a 288-column row's products). */
INLINE void reduce_heads(vfloat acc[HEADS], int nh, float s[HEADS]) {
#ifdef LS_AVX512
    __m512 t[4], u[2];
    for (int i = 0; i < 4; i++) /* per 128-bit lane: [a_0+a_2, b_0+b_2, a_1+a_3, b_1+b_3] for a, b = heads 2i, 2i+1 */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(acc[2 * i], acc[2 * i + 1]),
                             _mm512_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
    for (int i = 0; i < 2; i++) /* per 128-bit lane: heads 4i .. 4i + 3 */
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xee));
    __m512 v = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xdd));
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xb1)); /* lanes: heads 0-3, 0-3, 4-7, 4-7 */
    float all[16];
    _mm512_storeu_ps(all, v);
    for (int h = 0; h < nh; h++) s[h] = all[h < 4 ? h : h + 4];
#else
    for (int h = 0; h < nh; h++) s[h] = vreduce_add(acc[h]);
#endif
}

/* scores[h * ROW_TILE + p - p0] = q[h] . rows[p] (q scaled, fp32) for nh heads and p0 <= p < p1 (of n rows). */
INLINE void score_rows(const float *q, int64_t D, const char *const *rows, int cf, int64_t p0, int64_t p1,
                       int64_t n, int nh, float *scores) {
    for (int64_t p = p0; p < p1; p++) {
        prefetch_row(rows, p + PREFETCH_ROWS, n, D * kv_size(cf));
        vfloat acc[HEADS];
        float sums[HEADS];
        for (int h = 0; h < HEADS; h++) acc[h] = vzero();
        int64_t d = 0;
        for (; d + LANES <= D; d += LANES) {
            vfloat k = vload_kv(rows[p], cf, d);
            for (int h = 0; h < nh; h++) acc[h] = vfma(vload(q + h * D, 0, d), k, acc[h]);
        }
        reduce_heads(acc, nh, sums);
        for (int h = 0; h < nh; h++) {
            float s = sums[h];
            for (int64_t e = d; e < D; e++) s += q[h * D + e] * load_kv(rows[p], cf, e);
            scores[h * ROW_TILE + p - p0] = s;
        }
    }
}

/* acc[h * L + l] += sum_j w[h * ROW_TILE + j] * rows[j][l] over a tile's nt rows. */
INLINE void weigh_rows(const float *w, const char *const *rows, int cf, int64_t nt, int64_t L, int nh, float *acc) {
    int64_t l = 0;
    for (; l + LANES <= L; l += LANES) {
        vfloat a[HEADS];
        for (int h = 0; h < nh; h++) a[h] = vload(acc + h * L, 0, l);
        for (int64_t j = 0; j < nt; j++) {
            vfloat v = vload_kv(rows[j], cf, l);
            for (int h = 0; h < nh; h++) a[h] = vfma(vset1(w[h * ROW_TILE + j]), v, a[h]);
        }
        for (int h = 0; h < nh; h++) vstore(acc + h * L + l, a[h]);
    }
    for (; l < L; l++)
        for (int64_t j = 0; j < nt; j++)
            for (int h = 0; h < nh; h++) acc[h * L + l] += w[h * ROW_TILE + j] * load_kv(rows[j], cf, l);
}

/* A tile's scores in place -> exp(score - running max) per head, the running maxima and sums updated, and where a
 * head's maximum grew, its accumulated values and sum rescaled to the new one. */
static void online_softmax(float *scores, int64_t nt, int nh, float *maxima, float *sums, float *acc, int64_t L) {
    for (int h = 0; h < nh; h++) {
        float *s = scores + h * ROW_TILE, m = maxima[h], sum = 0.f;
        int64_t j = 0;
        vfloat mv = vset1(m);
        for (; j + LANES <= nt; j += LANES) mv = vmax(mv, vload(s, 0, j));
        m = vmax_reduce(mv);
        for (; j < nt; j++) m = s[j] > m ? s[j] : m;
        if (m > maxima[h] && sums[h] > 0.f) {
            float c = expf(maxima[h] - m);
            sums[h] *= c;
            for (int64_t l = 0; l < L; l++) acc[h * L + l] *= c;
        }
        maxima[h] = m;
        for (j = 0; j + LANES <= nt; j += LANES) {
            vfloat e = vexp(vsub(vload(s, 0, j), vset1(m)));
            vstore(s + j, e);
            sum += vreduce_add(e);
        }
        for (; j < nt; j++) {
            s[j] = expf(s[j] - m);
            sum += s[j];
        }
        sums[h] += sum;
    }
}

/* nh heads' results: into `out` normalized, or where `partial` is given, each head's running maximum, sum and
 * unnormalized values there (L + 2 floats a head) for combine_chunks. */
static void finish_heads(const float *maxima, const float *sums, const float *acc, int64_t nh, int64_t L, void *out,
                         int obf, float *partial) {
    for (int64_t h = 0; h < nh; h++) {
        if (partial) {
            float *part = partial + h * (L + 2);
            part[0] = maxima[h], part[1] = sums[h];
            memcpy(part + 2, acc + h * L, L * sizeof(float));
            continue;
        }
        float inv = 1.f / sums[h];
        for (int64_t l = 0; l < L; l++) store_out(out, obf, h * L + l, acc[h * L + l] * inv);
    }
}

/* One tile's rows p0 .. p1 for nh heads: scored against the scaled fp32 queries qs, the online softmax updated,
 * weighed into acc. `rows` fp32 or bf16 (rf). Rows ahead are prefetched up to n (0: none, for a tile just written). */
INLINE void attend_tile(const float *qs, int64_t D, int64_t L, const char *const *rows, int rf, int64_t p0,
                        int64_t p1, int64_t n, float *scores, float *maxima, float *sums, float *acc, int nh) {
    score_rows(qs, D, rows, rf, p0, p1, n, nh, scores);
    online_softmax(scores, p1 - p0, nh, maxima, sums, acc, L);
    weigh_rows(scores, rows + p0, rf, p1 - p0, L, nh, acc);
}

/* Heads h0 .. h0 + nh of one token over its visible rows p_begin .. p_end (of n) of an fp32 or bf16 cache, read in
 * place tile by tile in fp32; results as finish_heads gives them. */
INLINE void decode_item(const void *q, int qbf, int64_t D, int64_t L, const char *const *rows, int cf, int64_t p_begin,
                        int64_t p_end, float scale, void *out, int obf, float *partial, int nh) {
    float qs[HEADS * D], acc[HEADS * L], scores[HEADS * ROW_TILE], maxima[HEADS], sums[HEADS];
    for (int64_t i = 0; i < nh * L; i++) acc[i] = 0.f;
    for (int h = 0; h < nh; h++) maxima[h] = -INFINITY, sums[h] = 0.f;
    for (int64_t i = 0; i < nh * D; i++) qs[i] = scale * load_act(q, qbf, i);
    for (int64_t p0 = p_begin; p0 < p_end; p0 += ROW_TILE) {
        int64_t p1 = p0 + ROW_TILE < p_end ? p0 + ROW_TILE : p_end;
        attend_tile(qs, D, L, rows, cf, p0, p1, p_end, scores, maxima, sums, acc, nh);
    }
    finish_heads(maxima, sums, acc, nh, L, out, obf, partial);
}
