/* MLA's absorbed decode attention, read in place from the paged latent cache.
 *
 * q [T, H, D] (D = L + R: the absorbed latent query, then the rope query), the cache [blocks, B, D] (rows
 * [c_kv ‖ k_pe]), out [T, H, L]: out[t, h] = softmax_p(scale * q[t, h] . row_p) . row_p[:L] over the positions p
 * that token t sees. One work item is a token and a block of heads: the item reads each row of its request once
 * per pass for all its heads (scores, then values), in fp32, with an exact softmax in between. Items are shared
 * out among the threads; heads per item shrink so that every thread gets work.
 */
#include "simd.h"

#define HEADS 8       /* heads per item at most: their accumulators stay in registers */
#define ROW_TILE 64   /* positions per tile of the value pass: a tile's rows stay in cache across lane blocks */

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

/* scores[h * n + p] = q[h] . rows[p] (q scaled, fp32) for nh heads. */
INLINE void score_rows(const float *q, int64_t D, const char *const *rows, int cbf, int64_t n, int nh,
                       float *scores) {
    for (int64_t p = 0; p < n; p++) {
        prefetch_row(rows, p + PREFETCH_ROWS, n, D * (cbf ? 2 : 4));
        vfloat acc[HEADS];
        float sums[HEADS];
        for (int h = 0; h < HEADS; h++) acc[h] = vzero();
        int64_t d = 0;
        for (; d + LANES <= D; d += LANES) {
            vfloat k = vload(rows[p], cbf, d);
            for (int h = 0; h < nh; h++) acc[h] = vfma(vload(q + h * D, 0, d), k, acc[h]);
        }
        reduce_heads(acc, nh, sums);
        for (int h = 0; h < nh; h++) {
            float s = sums[h];
            for (int64_t e = d; e < D; e++) s += q[h * D + e] * load_act(rows[p], cbf, e);
            scores[h * n + p] = s;
        }
    }
}

/* acc[h * L + l] += sum_p w[h * n + p] * rows[p][l] over positions p0 <= p < p1. */
INLINE void weigh_rows(const float *w, const char *const *rows, int cbf, int64_t n, int64_t p0, int64_t p1, int64_t L,
                       int nh, float *acc) {
    int64_t l = 0;
    for (; l + LANES <= L; l += LANES) {
        vfloat a[HEADS];
        for (int h = 0; h < nh; h++) a[h] = vload(acc + h * L, 0, l);
        for (int64_t p = p0; p < p1; p++) {
            if (l == 0) /* the next tile's rows, which the score pass read long ago */
                prefetch_row(rows, p + ROW_TILE, n, L * (cbf ? 2 : 4));
            vfloat v = vload(rows[p], cbf, l);
            for (int h = 0; h < nh; h++) a[h] = vfma(vset1(w[h * n + p]), v, a[h]);
        }
        for (int h = 0; h < nh; h++) vstore(acc + h * L + l, a[h]);
    }
    for (; l < L; l++)
        for (int64_t p = p0; p < p1; p++)
            for (int h = 0; h < nh; h++) acc[h * L + l] += w[h * n + p] * load_act(rows[p], cbf, l);
}

#ifdef LS_BF16DOT
/* bf16 queries and cache on a CPU with AVX512-BF16: vdpbf16ps takes two columns a lane (exact products, summed in
 * fp32), twice the multiply-adds of an fp32 FMA per instruction. */

/* scores[h * n + p] = scale * (q[h] . rows[p]) for bf16 q and rows; columns past the last multiple of 32 in fp32. */
INLINE void score_rows_bf16(const uint16_t *q, int64_t D, const char *const *rows, int64_t n, int nh, float scale,
                            float *scores) {
    for (int64_t p = 0; p < n; p++) {
        prefetch_row(rows, p + PREFETCH_ROWS, n, D * 2);
        const uint16_t *row = (const uint16_t *)rows[p];
        __m512 acc[HEADS];
        float sums[HEADS];
        for (int h = 0; h < HEADS; h++) acc[h] = _mm512_setzero_ps();
        int64_t d = 0;
        for (; d + 32 <= D; d += 32) {
            __m512bh k = (__m512bh)_mm512_loadu_si512(row + d);
            for (int h = 0; h < nh; h++)
                acc[h] = _mm512_dpbf16_ps(acc[h], (__m512bh)_mm512_loadu_si512(q + h * D + d), k);
        }
        reduce_heads(acc, nh, sums);
        for (int h = 0; h < nh; h++) {
            float s = sums[h];
            for (int64_t e = d; e < D; e++) s += bf16_to_float(q[h * D + e]) * bf16_to_float(row[e]);
            scores[h * n + p] = scale * s;
        }
    }
}

/* vpunpck{l,h}wd interleave two rows per 128-bit lane: a 32-column block's sums come out as lo = columns
 * {0-3, 8-11, 16-19, 24-27}, hi = the others; these indices put them back in order (and take them apart). */
#define LO_HI_ORDER_0 _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23)
#define LO_HI_ORDER_1 _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31)
#define SPLIT_LO _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
#define SPLIT_HI _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31)

/* weigh_rows over bf16 rows, two positions a vdpbf16ps: `pairs` holds each head's weights rounded to bf16, positions
 * 2i and 2i + 1 in one int (low half first), and the rows are interleaved column by column. p0 is even. Columns past
 * the last multiple of 32 take the fp32 loop. */
INLINE void weigh_rows_bf16(const float *w, const int32_t *pairs, const char *const *rows, int64_t n, int64_t p0,
                            int64_t p1, int64_t L, int nh, float *acc) {
    int64_t l = 0;
    for (; l + 32 <= L; l += 32) {
        __m512 lo[HEADS], hi[HEADS];
        for (int h = 0; h < nh; h++) {
            __m512 a = _mm512_loadu_ps(acc + h * L + l), b = _mm512_loadu_ps(acc + h * L + l + 16);
            lo[h] = _mm512_permutex2var_ps(a, SPLIT_LO, b);
            hi[h] = _mm512_permutex2var_ps(a, SPLIT_HI, b);
        }
        for (int64_t p = p0; p < p1; p += 2) {
            if (l == 0) { /* the next tile's rows, which the score pass read long ago */
                prefetch_row(rows, p + ROW_TILE, n, L * 2);
                prefetch_row(rows, p + 1 + ROW_TILE, n, L * 2);
            }
            __m512i r0 = _mm512_loadu_si512((const uint16_t *)rows[p] + l);
            __m512i r1 = p + 1 < p1 ? _mm512_loadu_si512((const uint16_t *)rows[p + 1] + l) : _mm512_setzero_si512();
            __m512bh vl = (__m512bh)_mm512_unpacklo_epi16(r0, r1), vh = (__m512bh)_mm512_unpackhi_epi16(r0, r1);
            for (int h = 0; h < nh; h++) {
                __m512bh wp = (__m512bh)_mm512_set1_epi32(pairs[h * ((n + 1) / 2) + p / 2]);
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
        for (int64_t p = p0; p < p1; p++)
            for (int h = 0; h < nh; h++) acc[h * L + l] += w[h * n + p] * load_act(rows[p], 1, l);
}
#endif

/* Each head's scores in place -> exp(score - max), and 1 / their sum in inv[h]. */
static void softmax_rows(float *scores, int64_t n, int nh, float *inv) {
    for (int h = 0; h < nh; h++) {
        float *s = scores + h * n, m = -INFINITY, sum = 0.f;
        for (int64_t p = 0; p < n; p++) m = fmaxf(m, s[p]);
        int64_t p = 0;
        for (; p + LANES <= n; p += LANES) {
            vfloat e = vexp(vsub(vload(s, 0, p), vset1(m)));
            vstore(s + p, e);
            sum += vreduce_add(e);
        }
        for (; p < n; p++) {
            s[p] = expf(s[p] - m);
            sum += s[p];
        }
        inv[h] = 1.f / sum;
    }
}

/* Heads h0 .. h0 + nh of one token over its n visible rows. */
INLINE void decode_item(const void *q, int qbf, int64_t D, int64_t L, const char *const *rows, int cbf, int64_t n,
                        float scale, void *out, int obf, int nh) {
    float qs[HEADS * D], acc[HEADS * L], inv[HEADS];
    float *scores = malloc(nh * n * sizeof(float));
    for (int64_t i = 0; i < nh * L; i++) acc[i] = 0.f;
#ifdef LS_BF16DOT
    if (qbf && cbf) {
        int64_t half = (n + 1) / 2;
        int32_t *pairs = malloc(nh * half * sizeof(int32_t));
        score_rows_bf16(q, D, rows, n, nh, scale, scores);
        softmax_rows(scores, n, nh, inv);
        for (int h = 0; h < nh; h++)
            for (int64_t i = 0; i < half; i++) {
                const float *w = scores + h * n + 2 * i;
                pairs[h * half + i] = (int32_t)(float_to_bf16(w[0]) | (2 * i + 1 < n ? (uint32_t)float_to_bf16(w[1]) << 16 : 0u));
            }
        for (int64_t p = 0; p < n; p += ROW_TILE)
            weigh_rows_bf16(scores, pairs, rows, n, p, p + ROW_TILE < n ? p + ROW_TILE : n, L, nh, acc);
        free(pairs);
        for (int h = 0; h < nh; h++)
            for (int64_t l = 0; l < L; l++) store_out(out, obf, h * L + l, acc[h * L + l] * inv[h]);
        free(scores);
        return;
    }
#endif
    for (int64_t i = 0; i < nh * D; i++) qs[i] = scale * load_act(q, qbf, i);
    score_rows(qs, D, rows, cbf, n, nh, scores);
    softmax_rows(scores, n, nh, inv);
    for (int64_t p = 0; p < n; p += ROW_TILE)
        weigh_rows(scores, rows, cbf, n, p, p + ROW_TILE < n ? p + ROW_TILE : n, L, nh, acc);
    for (int h = 0; h < nh; h++)
        for (int64_t l = 0; l < L; l++) store_out(out, obf, h * L + l, acc[h * L + l] * inv[h]);
    free(scores);
}

/* Requests r < R: query tokens qsl[r] .. qsl[r + 1], seq_lens[r] positions in the blocks of block_table row r
 * (row stride bt_stride); query token j of a request with n new tokens sees positions 0 .. seq_len - n + j. `io`:
 * bit 0 q is bf16, bit 1 the cache, bit 2 out (else fp32). */
void ls_mla_decode(const void *q, int64_t T, int64_t H, int64_t D, int64_t L, const void *cache, int64_t B,
                   const int32_t *block_table, int64_t bt_stride, const int32_t *qsl, const int32_t *seq_lens,
                   int64_t R, float scale, void *out, int io, int threads) {
    int qbf = io & 1, cbf = (io >> 1) & 1, obf = (io >> 2) & 1;
    int64_t esize = cbf ? 2 : 4, max_len = 0;
    for (int64_t r = 0; r < R; r++) max_len = seq_lens[r] > max_len ? seq_lens[r] : max_len;
    /* Every request's row addresses once (the items of its tokens share them). */
    const char **rows = malloc((R * max_len + 1) * sizeof(char *));
    int64_t *request = malloc((T + 1) * sizeof(int64_t));
    for (int64_t r = 0; r < R; r++) {
        for (int64_t b = 0, p = 0; p < seq_lens[r]; b++) {
            const char *block = (const char *)cache + (int64_t)block_table[r * bt_stride + b] * B * D * esize;
            for (int64_t i = 0; i < B && p < seq_lens[r]; i++, p++) rows[r * max_len + p] = block + i * D * esize;
        }
        for (int64_t t = qsl[r]; t < qsl[r + 1]; t++) request[t] = r;
    }
    int64_t per = (T * H + threads - 1) / threads;
    int heads = per < 1 ? 1 : per > HEADS ? HEADS : (int)per;
    int64_t blocks = (H + heads - 1) / heads;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t item = 0; item < T * blocks; item++) {
        int64_t t = item / blocks, h0 = item % blocks * heads, r = request[t];
        int nh = H - h0 < heads ? (int)(H - h0) : heads;
        int64_t n = seq_lens[r] - (qsl[r + 1] - qsl[r]) + (t - qsl[r]) + 1;
        const void *qt = (const char *)q + (t * H + h0) * D * (qbf ? 2 : 4);
        void *ot = (char *)out + (t * H + h0) * L * (obf ? 2 : 4);
        const char *const *rr = rows + r * max_len;
        switch (nh) { /* a constant head count per instance: the accumulators live in registers */
        case 1: decode_item(qt, qbf, D, L, rr, cbf, n, scale, ot, obf, 1); break;
        case 2: decode_item(qt, qbf, D, L, rr, cbf, n, scale, ot, obf, 2); break;
        case 3: decode_item(qt, qbf, D, L, rr, cbf, n, scale, ot, obf, 3); break;
        case 4: decode_item(qt, qbf, D, L, rr, cbf, n, scale, ot, obf, 4); break;
        case 5: decode_item(qt, qbf, D, L, rr, cbf, n, scale, ot, obf, 5); break;
        case 6: decode_item(qt, qbf, D, L, rr, cbf, n, scale, ot, obf, 6); break;
        case 7: decode_item(qt, qbf, D, L, rr, cbf, n, scale, ot, obf, 7); break;
        default: decode_item(qt, qbf, D, L, rr, cbf, n, scale, ot, obf, 8); break;
        }
    }
    free(rows);
    free(request);
}
