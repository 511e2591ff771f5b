/* The tiles of MLA's absorbed decode attention (mla_decode.c): a tile's rows scored against an item's queries,
 * the online softmax over the scores, the rows weighed into the accumulators, for each cache row format (fp32,
 * bf16, and fp8 / int8 rows scored as they are converted), and one item of an fp32 or bf16 cache walked tile by
 * tile (decode_item). mla_decode.c drives them: items, chunks, the quantized caches' items, the combination. */
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

#ifdef LS_BF16DOT
/* bf16 queries and cache on a CPU with AVX512-BF16: vdpbf16ps takes two columns a lane (exact products, summed in
 * fp32), twice the multiply-adds of an fp32 FMA per instruction. */

INLINE __m512i load_bf16x32(const char *row, int64_t i) { return _mm512_loadu_si512((const uint16_t *)row + i); }

/* score_rows for bf16 q and rows: scale * (q[h] . rows[p]); columns past the last multiple of 32 in fp32. Two rows
 * a pass, so that each load of q feeds two products. */
INLINE void score_rows_bf16(const uint16_t *q, int64_t D, const char *const *rows, int cf, int64_t p0, int64_t p1,
                            int64_t n, int nh, float scale, float *scores) {
    for (int64_t p = p0; p < p1; p += 2) {
        prefetch_row(rows, p + PREFETCH_ROWS, n, D * kv_size(cf));
        prefetch_row(rows, p + PREFETCH_ROWS + 1, n, D * kv_size(cf));
        int two = p + 1 < p1;
        const char *row[2] = {rows[p], rows[two ? p + 1 : p]};
        __m512 acc[2][HEADS];
        float sums[2][HEADS];
        for (int h = 0; h < HEADS; h++) acc[0][h] = acc[1][h] = _mm512_setzero_ps();
        int64_t d = 0;
        for (; d + 32 <= D; d += 32) {
            __m512bh k0 = (__m512bh)load_bf16x32(row[0], d), k1 = (__m512bh)load_bf16x32(row[1], d);
            for (int h = 0; h < nh; h++) {
                __m512bh qh = (__m512bh)_mm512_loadu_si512(q + h * D + d);
                acc[0][h] = _mm512_dpbf16_ps(acc[0][h], qh, k0);
                acc[1][h] = _mm512_dpbf16_ps(acc[1][h], qh, k1);
            }
        }
        for (int i = 0; i < 1 + two; i++) {
            reduce_heads(acc[i], nh, sums[i]);
            for (int h = 0; h < nh; h++) {
                float s = sums[i][h];
                for (int64_t e = d; e < D; e++) s += bf16_to_float(q[h * D + e]) * load_kv(row[i], cf, e);
                scores[h * ROW_TILE + p + i - p0] = scale * s;
            }
        }
    }
}

/* vpunpck{l,h}wd interleave two rows per 128-bit lane: a 32-column block's sums come out as lo = columns
 * {0-3, 8-11, 16-19, 24-27}, hi = the others; these indices put them back in order (and take them apart). */
#define LO_HI_ORDER_0 _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23)
#define LO_HI_ORDER_1 _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31)
#define SPLIT_LO _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
#define SPLIT_HI _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31)

/* weigh_rows over bf16 rows, two positions a vdpbf16ps: the weights rounded to bf16, rows 2i and 2i + 1 in one int
 * (low half first), the rows interleaved column by column. Columns past the last multiple of 32 take the fp32 loop. */
INLINE void weigh_rows_bf16(const float *w, const char *const *rows, int cf, int64_t nt, int64_t L, int nh,
                            float *acc) {
    int32_t pairs[HEADS * ROW_TILE / 2];
    for (int h = 0; h < nh; h++)
        for (int64_t j = 0; j < nt; j += 2) {
            const float *wj = w + h * ROW_TILE + j;
            pairs[h * ROW_TILE / 2 + j / 2] =
                (int32_t)(float_to_bf16(wj[0]) | (j + 1 < nt ? (uint32_t)float_to_bf16(wj[1]) << 16 : 0u));
        }
    int64_t l = 0;
    for (; l + 32 <= L; l += 32) {
        __m512 lo[HEADS], hi[HEADS];
        for (int h = 0; h < nh; h++) {
            __m512 a = _mm512_loadu_ps(acc + h * L + l), b = _mm512_loadu_ps(acc + h * L + l + 16);
            lo[h] = _mm512_permutex2var_ps(a, SPLIT_LO, b);
            hi[h] = _mm512_permutex2var_ps(a, SPLIT_HI, b);
        }
        for (int64_t j = 0; j < nt; j += 2) {
            __m512i r0 = load_bf16x32(rows[j], l);
            __m512i r1 = j + 1 < nt ? load_bf16x32(rows[j + 1], l) : _mm512_setzero_si512();
            __m512bh vl = (__m512bh)_mm512_unpacklo_epi16(r0, r1), vh = (__m512bh)_mm512_unpackhi_epi16(r0, r1);
            for (int h = 0; h < nh; h++) {
                __m512bh wp = (__m512bh)_mm512_set1_epi32(pairs[h * ROW_TILE / 2 + j / 2]);
                lo[h] = _mm512_dpbf16_ps(lo[h], wp, vl);
                hi[h] = _mm512_dpbf16_ps(hi[h], wp, vh);
            }
        }
        for (int h = 0; h < nh; h++) {
            _mm512_storeu_ps(acc + h * L + l, _mm512_permutex2var_ps(lo[h], LO_HI_ORDER_0, hi[h]));
            _mm512_storeu_ps(acc + h * L + l + 16, _mm512_permutex2var_ps(lo[h], LO_HI_ORDER_1, hi[h]));
        }
    }
    for (; l < L; l++)
        for (int64_t j = 0; j < nt; j++)
            for (int h = 0; h < nh; h++) acc[h * L + l] += w[h * ROW_TILE + j] * load_kv(rows[j], cf, l);
}

/* Columns d .. d + 64 of an fp8 or int8 row in bf16, as dequantize_row_bf16 gives them (an int8 row's c_kv scale
 * below column L, its k_pe scale from L on: L a multiple of 64). */
VBMI INLINE void quantized_bf16x64(const char *row, int cf, int64_t d, int64_t L, const float scales[2],
                                   __m512i y[2]) {
    if (cf == KV_FP8) {
        fp8x64_to_bf16((const uint8_t *)row + d, y);
        return;
    }
    __m512 s = _mm512_set1_ps(scales[d >= L]);
    y[0] = int8x32_to_bf16((const int8_t *)row + d, s);
    y[1] = int8x32_to_bf16((const int8_t *)row + d + 32, s);
}

/* score_rows_bf16 for HEADS heads over rows p0 .. p1 (of n) of an fp8 or int8 cache, each row dequantized to bf16 in
 * registers as it is scored and stored to `tile` (D values a row; addresses to tile_rows) for the passes after: the
 * conversion's shuffles run beside the products instead of in a pass of their own, where the product units idle
 * (a lone request's 16 heads over an L3-resident cache ran ~5 % (fp8) and ~10 % (int8) slower than bf16 rows that
 * way). The same bits as dequantize_tile, then score_rows_bf16. Prefetches as dequantize_tile. D, L multiples of 64. */
VBMI static void score_quantized_rows(const uint16_t *q, int64_t D, int64_t L, const char *const *rows, int cf,
                                      int64_t p0, int64_t p1, int64_t n, int first, float scale, float *scores,
                                      uint16_t *tile, const char **tile_rows) {
    int64_t row_bytes = kv_row_bytes(cf, D);
    for (int64_t p = p0; p < p1; p += 2) {
        for (int64_t i = 0; i < 2; i++) {
            if (first) prefetch_row(rows, p + i + PREFETCH_ROWS, n, row_bytes);
            prefetch_row(rows, p + i + ROW_TILE, n, row_bytes);
        }
        int two = p + 1 < p1;
        const char *row[2] = {rows[p], rows[two ? p + 1 : p]};
        uint16_t *dst[2] = {tile + (p - p0) * D, tile + (p - p0 + two) * D};
        tile_rows[p - p0] = (const char *)dst[0];
        if (two) tile_rows[p - p0 + 1] = (const char *)dst[1];
        float sc[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
        if (cf == KV_INT8) int8_scales(row[0], D, sc[0]), int8_scales(row[1], D, sc[1]);
        __m512 acc[2][HEADS];
        float sums[2][HEADS];
        for (int h = 0; h < HEADS; h++) acc[0][h] = acc[1][h] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 64) {
            __m512i k[2][2];
            for (int i = 0; i < 2; i++) {
                quantized_bf16x64(row[i], cf, d, L, sc[i], k[i]);
                _mm512_storeu_si512(dst[i] + d, k[i][0]);
                _mm512_storeu_si512(dst[i] + d + 32, k[i][1]);
            }
            for (int h = 0; h < HEADS; h++)
                for (int c = 0; c < 2; c++) { /* columns d + 32c, in score_rows_bf16's order */
                    __m512bh qh = (__m512bh)_mm512_loadu_si512(q + h * D + d + 32 * c);
                    acc[0][h] = _mm512_dpbf16_ps(acc[0][h], qh, (__m512bh)k[0][c]);
                    acc[1][h] = _mm512_dpbf16_ps(acc[1][h], qh, (__m512bh)k[1][c]);
                }
        }
        for (int i = 0; i < 1 + two; i++) {
            reduce_heads(acc[i], HEADS, sums[i]);
            for (int h = 0; h < HEADS; h++) scores[h * ROW_TILE + p + i - p0] = scale * sums[i][h];
        }
    }
}
#endif

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

/* One tile's rows p0 .. p1 for nh heads: scored, the online softmax updated, weighed into acc. `rows` fp32 or bf16
 * (rf); q bf16 through vdpbf16ps where `dot`, else the scaled fp32 queries qs. Rows ahead are prefetched up to n (0:
 * none, for a tile just written). */
INLINE void attend_tile(const void *q, const float *qs, int dot, int64_t D, int64_t L, const char *const *rows, int rf,
                        int64_t p0, int64_t p1, int64_t n, float scale, float *scores, float *maxima, float *sums,
                        float *acc, int nh) {
#ifdef LS_BF16DOT
    if (dot) {
        score_rows_bf16(q, D, rows, rf, p0, p1, n, nh, scale, scores);
        online_softmax(scores, p1 - p0, nh, maxima, sums, acc, L);
        weigh_rows_bf16(scores, rows + p0, rf, p1 - p0, L, nh, acc);
        return;
    }
#endif
    (void)q, (void)dot, (void)scale;
    score_rows(qs, D, rows, rf, p0, p1, n, nh, scores);
    online_softmax(scores, p1 - p0, nh, maxima, sums, acc, L);
    weigh_rows(scores, rows + p0, rf, p1 - p0, L, nh, acc);
}

/* Heads h0 .. h0 + nh of one token over its visible rows p_begin .. p_end (of n) of an fp32 or bf16 cache, read in
 * place tile by tile; results as finish_heads gives them. */
INLINE void decode_item(const void *q, int qbf, int64_t D, int64_t L, const char *const *rows, int cf, int64_t p_begin,
                        int64_t p_end, float scale, void *out, int obf, float *partial, int nh) {
    float qs[HEADS * D], acc[HEADS * L], scores[HEADS * ROW_TILE], maxima[HEADS], sums[HEADS];
    for (int64_t i = 0; i < nh * L; i++) acc[i] = 0.f;
    for (int h = 0; h < nh; h++) maxima[h] = -INFINITY, sums[h] = 0.f;
#ifdef LS_BF16DOT
    int dot = qbf && cf == KV_BF16; /* bf16 products through vdpbf16ps */
#else
    int dot = 0;
#endif
    if (!dot)
        for (int64_t i = 0; i < nh * D; i++) qs[i] = scale * load_act(q, qbf, i);
    for (int64_t p0 = p_begin; p0 < p_end; p0 += ROW_TILE) {
        int64_t p1 = p0 + ROW_TILE < p_end ? p0 + ROW_TILE : p_end;
        attend_tile(q, qs, dot, D, L, rows, cf, p0, p1, p_end, scale, scores, maxima, sums, acc, nh);
    }
    finish_heads(maxima, sums, acc, nh, L, out, obf, partial);
}
