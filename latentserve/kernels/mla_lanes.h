/* MLA decode attention's tiles with the heads in the vector lanes, for bf16 queries under AVX512-BF16 (mla_decode.c
 * drives them). MLA decode is MQA: every head attends the same rows. So two columns of a row, broadcast to all lanes,
 * meet 16 heads' query columns in one vdpbf16ps; a position's scores come out as one vector of 16 heads, with no sum
 * across lanes (a head a vector, as mla_tiles.h's fp32 tiles score, costs a reduction per head and position), one
 * load of the queries serves LANE_ROWS rows, and the online softmax, exp included, runs on 16 heads at once. The
 * rows are bf16: the cache's own, read in place, or an fp8 / int8 tile dequantized to bf16. Each lane computes its
 * head alone, in the same order whatever shares the vector, so a head's result does not depend on how the heads
 * are split in items (the threads, the batch). */
#pragma once

#include "mla_tiles.h"

#define LANE_HEADS 16 /* heads a group: one fp32 vector of scores per position */
#define LANE_ROWS 8   /* rows a scoring pass: their accumulators in registers, each load of the queries feeds 8 */
#define WEIGH_HEADS 8 /* heads a weighing pass: two accumulators each in registers */

#ifdef LS_BF16DOT
/* A bf16 row's column pairs read as int32 where the row was written as uint16 (a dequantized tile), at a 2-byte
 * alignment (an odd D's rows start at every other byte pair). */
typedef int32_t __attribute__((may_alias, aligned(2))) bf16_pair;

/* One group of up to LANE_HEADS heads of an item: their queries as bf16 column pairs, head h in lane h (qt[k *
 * LANE_HEADS + h] = q[h][2k] | q[h][2k + 1] << 16; 0 in the lanes past nh), an odd D's last column in fp32 (q_last),
 * the running maxima and sums and the accumulated values (L a head; every lane has them, used or not). */
typedef struct {
    int32_t *qt;
    float *q_last, *maxima, *sums, *acc;
    int nh;
} LaneGroup;

/* The group's state before its first row: queries from q (nh heads of D bf16 values), nothing accumulated. */
static void lane_group_start(LaneGroup g, const uint16_t *q, int64_t D, int64_t L) {
    memset(g.qt, 0, D / 2 * LANE_HEADS * sizeof(int32_t));
    for (int h = 0; h < g.nh; h++) /* a pair's two bf16 values as one little-endian int32: q[h][2k] the low half */
        for (int64_t k = 0; k < D / 2; k++) memcpy(g.qt + k * LANE_HEADS + h, q + h * D + 2 * k, sizeof(int32_t));
    for (int h = 0; h < LANE_HEADS; h++) {
        g.q_last[h] = h < g.nh && D % 2 ? bf16_to_float(q[h * D + D - 1]) : 0.f;
        g.maxima[h] = -INFINITY, g.sums[h] = 0.f;
    }
    memset(g.acc, 0, LANE_HEADS * L * sizeof(float));
}

/* Row p's bytes asked for into L2 where p < n: read from memory a tile ahead of its use, a whole tile's work hides
 * the memory's latency, which the next pass's rows asked for into L1 alone do not. */
INLINE void prefetch_row_l2(const char *const *rows, int64_t p, int64_t n, int64_t bytes) {
    if (p < n)
        for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(rows[p] + b, _MM_HINT_T1);
}

/* One pass's rows p.. (at most LANE_ROWS, up to p1) into r, and its rows' prefetches: the next pass's into L1, those
 * a tile ahead into L2, up to n. Returns the pass's row count m; r past m repeats the pass's first row (unused). */
INLINE int64_t lane_pass_rows(const char *const *rows, int64_t p, int64_t p1, int64_t n, int64_t D,
                              const bf16_pair **r) {
    int64_t m = p1 - p < LANE_ROWS ? p1 - p : LANE_ROWS;
    for (int i = 0; i < LANE_ROWS; i++) {
        prefetch_row(rows, p + LANE_ROWS + i, n, 2 * D);
        prefetch_row_l2(rows, p + ROW_TILE + i, n, 2 * D);
        r[i] = (const bf16_pair *)rows[p + (i < m ? i : 0)];
    }
    return m;
}

/* scores[(p - p0) * LANE_HEADS + h] = scale * (q[h] . rows[p]) for bf16 rows p0 <= p < p1 of D columns, LANE_ROWS
 * rows a pass; the next pass's rows and those a tile ahead are prefetched, up to n (0: none, for a tile just
 * written). */
static void score_rows_lanes(LaneGroup g, int64_t D, const char *const *rows, int64_t p0, int64_t p1, int64_t n,
                             float scale, float *scores) {
    for (int64_t p = p0; p < p1; p += LANE_ROWS) {
        const bf16_pair *r[LANE_ROWS];
        int64_t m = lane_pass_rows(rows, p, p1, n, D, r);
        __m512 acc[LANE_ROWS];
        for (int i = 0; i < LANE_ROWS; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t k = 0; k < D / 2; k++) {
            __m512bh qk = (__m512bh)_mm512_loadu_si512(g.qt + k * LANE_HEADS);
            for (int i = 0; i < LANE_ROWS; i++)
                acc[i] = _mm512_dpbf16_ps(acc[i], qk, (__m512bh)_mm512_set1_epi32(r[i][k]));
        }
        for (int i = 0; i < m; i++) {
            if (D % 2) {
                __m512 last = _mm512_set1_ps(bf16_to_float(((const uint16_t *)r[i])[D - 1]));
                acc[i] = _mm512_fmadd_ps(_mm512_loadu_ps(g.q_last), last, acc[i]);
            }
            _mm512_storeu_ps(scores + (p - p0 + i) * LANE_HEADS, _mm512_mul_ps(acc[i], _mm512_set1_ps(scale)));
        }
    }
}

/* score_rows_lanes for a group of at most 8 heads, on their 8 lanes (the 256-bit vdpbf16ps: half the work where the
 * CPU splits 512-bit vectors in two; each lane's arithmetic is the 512-bit one's); the other 8 lanes' scores 0. */
static void score_rows_lanes8(LaneGroup g, int64_t D, const char *const *rows, int64_t p0, int64_t p1, int64_t n,
                              float scale, float *scores) {
    for (int64_t p = p0; p < p1; p += LANE_ROWS) {
        const bf16_pair *r[LANE_ROWS];
        int64_t m = lane_pass_rows(rows, p, p1, n, D, r);
        __m256 acc[LANE_ROWS];
        for (int i = 0; i < LANE_ROWS; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t k = 0; k < D / 2; k++) {
            __m256bh qk = (__m256bh)_mm256_loadu_si256((const __m256i *)(g.qt + k * LANE_HEADS));
            for (int i = 0; i < LANE_ROWS; i++)
                acc[i] = _mm256_dpbf16_ps(acc[i], qk, (__m256bh)_mm256_set1_epi32(r[i][k]));
        }
        for (int i = 0; i < m; i++) {
            if (D % 2) {
                __m512 last = _mm512_set1_ps(bf16_to_float(((const uint16_t *)r[i])[D - 1])); /* (no FMA flag) */
                acc[i] = _mm512_castps512_ps256(_mm512_fmadd_ps(_mm512_loadu_ps(g.q_last), last,
                                                                _mm512_castps256_ps512(acc[i])));
            }
            _mm512_storeu_ps(scores + (p - p0 + i) * LANE_HEADS,
                             _mm512_castps256_ps512(_mm256_mul_ps(acc[i], _mm256_set1_ps(scale))));
            _mm256_storeu_ps(scores + (p - p0 + i) * LANE_HEADS + 8, _mm256_setzero_ps());
        }
    }
}

/* 16 fp32 values -> bf16 bits (nearest even), one a 32-bit lane. */
INLINE __m512i bf16_lanes(__m512 x) { return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)); }

/* A tile's scores (nt positions) in place -> exp(score - running max) per head, the running maxima and sums
 * updated; where a head's maximum grew, its accumulated values and sum rescaled first. The weights also as bf16
 * pairs of positions for weigh_rows_lanes: pairs[j / 2 * LANE_HEADS + h] = w[j][h] | w[j + 1][h] << 16 (0 past nt). */
static void softmax_lanes(LaneGroup g, float *scores, int64_t nt, int64_t L, int32_t *pairs) {
    __m512 old = _mm512_loadu_ps(g.maxima), m = old, sum = _mm512_loadu_ps(g.sums);
    for (int64_t j = 0; j < nt; j++) m = _mm512_max_ps(m, _mm512_loadu_ps(scores + j * LANE_HEADS));
    __mmask16 grew = _mm512_cmp_ps_mask(m, old, _CMP_GT_OQ) &
                     _mm512_cmp_ps_mask(sum, _mm512_setzero_ps(), _CMP_GT_OQ) & ((1u << g.nh) - 1);
    if (grew) {
        __m512 c = vexp(_mm512_sub_ps(old, m));
        sum = _mm512_mask_mul_ps(sum, grew, sum, c);
        float cs[LANE_HEADS];
        _mm512_storeu_ps(cs, c);
        for (int h = 0; h < g.nh; h++)
            if (grew >> h & 1)
                for (int64_t l = 0; l < L; l++) g.acc[h * L + l] *= cs[h];
    }
    for (int64_t j = 0; j < nt; j += 2) {
        __m512 e0 = vexp(_mm512_sub_ps(_mm512_loadu_ps(scores + j * LANE_HEADS), m)), e1 = _mm512_setzero_ps();
        _mm512_storeu_ps(scores + j * LANE_HEADS, e0);
        sum = _mm512_add_ps(sum, e0);
        if (j + 1 < nt) {
            e1 = vexp(_mm512_sub_ps(_mm512_loadu_ps(scores + (j + 1) * LANE_HEADS), m));
            _mm512_storeu_ps(scores + (j + 1) * LANE_HEADS, e1);
            sum = _mm512_add_ps(sum, e1);
        }
        _mm512_storeu_si512(pairs + j / 2 * LANE_HEADS,
                            _mm512_or_si512(bf16_lanes(e0), _mm512_slli_epi32(bf16_lanes(e1), 16)));
    }
    _mm512_storeu_ps(g.maxima, m);
    _mm512_storeu_ps(g.sums, sum);
}

INLINE __m512i load_bf16x32(const char *row, int64_t i) { return _mm512_loadu_si512((const uint16_t *)row + i); }

/* vpunpck{l,h}wd interleave two rows per 128-bit lane: a 32-column block's sums come out as lo = columns
 * {0-3, 8-11, 16-19, 24-27}, hi = the others; these indices put them back in order (and take them apart). */
#define LO_HI_ORDER_0 _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23)
#define LO_HI_ORDER_1 _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31)
#define SPLIT_LO _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
#define SPLIT_HI _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31)

/* acc[h * L + l] += sum_j w[j][h] * rows[j][l] for WEIGH_HEADS heads over a tile's nt bf16 rows, two positions a
 * vdpbf16ps (softmax_lanes' pairs against rows 2i and 2i + 1 interleaved column by column); columns past the last
 * multiple of 32 in fp32 from the unrounded weights w (LANE_HEADS apart, as the pairs). */
static void weigh_rows_lanes(const float *w, const int32_t *pairs, const char *const *rows, int64_t nt, int64_t L,
                             float *acc) {
    int64_t l = 0;
    for (; l + 32 <= L; l += 32) {
        __m512 lo[WEIGH_HEADS], hi[WEIGH_HEADS];
        for (int h = 0; h < WEIGH_HEADS; h++) {
            __m512 a = _mm512_loadu_ps(acc + h * L + l), b = _mm512_loadu_ps(acc + h * L + l + 16);
            lo[h] = _mm512_permutex2var_ps(a, SPLIT_LO, b);
            hi[h] = _mm512_permutex2var_ps(a, SPLIT_HI, b);
        }
        for (int64_t j = 0; j < nt; j += 2) {
            __m512i r0 = load_bf16x32(rows[j], l);
            __m512i r1 = j + 1 < nt ? load_bf16x32(rows[j + 1], l) : _mm512_setzero_si512();
            __m512bh vl = (__m512bh)_mm512_unpacklo_epi16(r0, r1), vh = (__m512bh)_mm512_unpackhi_epi16(r0, r1);
            for (int h = 0; h < WEIGH_HEADS; h++) {
                __m512bh wp = (__m512bh)_mm512_set1_epi32(pairs[j / 2 * LANE_HEADS + h]);
                lo[h] = _mm512_dpbf16_ps(lo[h], wp, vl);
                hi[h] = _mm512_dpbf16_ps(hi[h], wp, vh);
            }
        }
        for (int h = 0; h < WEIGH_HEADS; h++) {
            _mm512_storeu_ps(acc + h * L + l, _mm512_permutex2var_ps(lo[h], LO_HI_ORDER_0, hi[h]));
            _mm512_storeu_ps(acc + h * L + l + 16, _mm512_permutex2var_ps(lo[h], LO_HI_ORDER_1, hi[h]));
        }
    }
    for (; l < L; l++)
        for (int64_t j = 0; j < nt; j++)
            for (int h = 0; h < WEIGH_HEADS; h++)
                acc[h * L + l] += w[j * LANE_HEADS + h] * bf16_to_float(((const uint16_t *)rows[j])[l]);
}

/* A tile's nt bf16 rows, scored (scores), for the group: the online softmax updated, the rows weighed into its
 * accumulators, WEIGH_HEADS lanes a pass up to its heads. */
static void weigh_tile_lanes(LaneGroup g, int64_t L, const char *const *rows, int64_t nt, float *scores,
                             int32_t *pairs) {
    softmax_lanes(g, scores, nt, L, pairs);
    for (int h = 0; h < g.nh; h += WEIGH_HEADS)
        weigh_rows_lanes(scores + h, pairs + h, rows, nt, L, g.acc + h * L);
}

/* One tile of bf16 rows p0 .. p1 (of n, for the prefetches) for the group: scored, then weigh_tile_lanes. */
static void attend_tile_lanes(LaneGroup g, int64_t D, int64_t L, const char *const *rows, int64_t p0, int64_t p1,
                              int64_t n, float scale, float *scores, int32_t *pairs) {
    if (g.nh <= 8)
        score_rows_lanes8(g, D, rows, p0, p1, n, scale, scores);
    else
        score_rows_lanes(g, D, rows, p0, p1, n, scale, scores);
    weigh_tile_lanes(g, L, rows + p0, p1 - p0, scores, pairs);
}
#endif
