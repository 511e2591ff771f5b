/* fp32 and bf16 products for few rows (decode), fp32 sums: linear layers y[M, N] = x[M, K] @ w[N, K]^T,
 * gated MLPs (experts) for a few tokens in one call, and MLA's absorbed per-head products.
 *
 * Each thread walks its share of w's rows, one row at a time, all activation rows against it: one stream of
 * weights per thread, every weight read once. PyTorch's products leave bandwidth unused at these shapes: MKL runs
 * a one-row fp32 product on one thread, oneDNN's one-row bf16 product reads ~15 GB/s on two.
 */
#include "simd.h"

/* dot[i] = x[i] . w over K columns, x fp32 (rows K apart), w fp32 or bf16. */
INLINE void dense_rows(const float *x, const void *w, int wbf, int64_t K, int mb, float dot[MB]) {
    vfloat acc[MB], acc2[MB]; /* two chains per row: an FMA's latency is longer than a load's issue */
    for (int i = 0; i < mb; i++) acc[i] = acc2[i] = vzero();
    int64_t k = 0;
    for (; k + 2 * LANES <= K; k += 2 * LANES) {
        vfloat wv = vload(w, wbf, k), wv2 = vload(w, wbf, k + LANES);
        for (int i = 0; i < mb; i++) {
            acc[i] = vfma(vload(x + i * K, 0, k), wv, acc[i]);
            acc2[i] = vfma(vload(x + i * K, 0, k + LANES), wv2, acc2[i]);
        }
    }
    for (; k + LANES <= K; k += LANES) {
        vfloat wv = vload(w, wbf, k);
        for (int i = 0; i < mb; i++) acc[i] = vfma(vload(x + i * K, 0, k), wv, acc[i]);
    }
    for (int i = 0; i < mb; i++) {
        float d = vreduce_add(vadd(acc[i], acc2[i]));
        for (int64_t t = k; t < K; t++) d += x[i * K + t] * load_act(w, wbf, t);
        dot[i] = d;
    }
}

#ifdef LS_BF16DOT
/* dense_rows for bf16 x and w: vdpbf16ps, two columns a lane (exact products, fp32 sums). */
INLINE void dense_rows_bf16(const uint16_t *x, const uint16_t *w, int64_t K, int mb, float dot[MB]) {
    __m512 acc[MB], acc2[MB];
    for (int i = 0; i < mb; i++) acc[i] = acc2[i] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k), wv2 = (__m512bh)_mm512_loadu_si512(w + k + 32);
        for (int i = 0; i < mb; i++) {
            acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(x + i * K + k), wv);
            acc2[i] = _mm512_dpbf16_ps(acc2[i], (__m512bh)_mm512_loadu_si512(x + i * K + k + 32), wv2);
        }
    }
    for (; k + 32 <= K; k += 32) {
        __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k);
        for (int i = 0; i < mb; i++) acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(x + i * K + k), wv);
    }
    for (int i = 0; i < mb; i++) {
        float d = _mm512_reduce_add_ps(_mm512_add_ps(acc[i], acc2[i]));
        for (int64_t t = k; t < K; t++) d += bf16_to_float(x[i * K + t]) * bf16_to_float(w[t]);
        dot[i] = d;
    }
}
#endif

/* `io`: bit 0 x is bf16, bit 1 y, bit 2 w (else fp32). */
int dense_linear(const void *x, int64_t M, int64_t K, const void *w, int64_t N, void *y, int io, int threads) {
    int wbf = (io >> 2) & 1;
    int64_t wsize = wbf ? 2 : 4;
#ifdef LS_BF16DOT
    int dot = wbf && (io & 1); /* bf16 x and w: products through vdpbf16ps, x read as it is */
#else
    int dot = 0;
#endif
    ScratchMark mark = scratch_mark();
    float *xf = dot ? NULL : scratch(M * K * sizeof(float));
    if (!dot && !xf) return scratch_release(mark), LS_NO_MEMORY;
    if (!dot)
        for (int64_t i = 0; i < M * K; i++) xf[i] = load_act(x, io & 1, i);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const void *row = (const char *)w + n * K * wsize;
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
            int mb = M - m0 < MB ? (int)(M - m0) : MB;
            float out[MB];
#ifdef LS_BF16DOT
            if (dot)
                FOR_ROWS(dense_rows_bf16, (const uint16_t *)x + m0 * K, (const uint16_t *)row, K)
            else
#endif
                FOR_ROWS(dense_rows, xf + m0 * K, row, wbf, K)
            for (int i = 0; i < mb; i++) store_out(y, io & 2, (m0 + i) * N + n, out[i]);
        }
    }
    scratch_release(mark);
    return LS_OK;
}

#define DOWN_UNIT 32 /* output columns of the down projections a thread takes at a time: whole cache lines */

/* T tokens, each through `count` gated MLPs of intermediate size I with fp32 or bf16 weights (bit 2 of `io`):
 * y[t] = sum_c gates[t * count + c] * down_c(silu(gate_c(x[t])) * up_c(x[t])) in the order given, in one parallel
 * region. Pair p = t * count + c reads its gate rows at gate[p], its up rows at up[p] (`[I, K]` each) and its down
 * projection stored transposed at down_t[p] (`[I, K]`). All pairs' gate and up rows are shared out among the
 * threads, then the down projections' output columns, in units of DOWN_UNIT: each thread streams its columns of
 * every down row, summing rows in order, so that a result does not depend on the thread count (splitting the rows
 * instead summed partial sums per thread). A token's result does not depend on the others in the call either (its
 * own rows, sums in the same order). */
LS_API int ls_dense_experts(const void *x, int64_t T, int64_t K, int64_t I, int64_t count, const void *const *gate,
                            const void *const *up, const void *const *down_t, const float *gates, void *y, int io,
                            int threads) {
    int wbf = (io >> 2) & 1;
    int64_t wsize = wbf ? 2 : 4, P = T * count;
#ifdef LS_BF16DOT
    int dot = wbf && (io & 1); /* bf16 x and weights: gate and up through vdpbf16ps, x read as it is */
#else
    int dot = 0;
#endif
    ScratchMark mark = scratch_mark();
    float *xf = dot ? NULL : scratch(T * K * sizeof(float)), *h = scratch(P * 2 * I * sizeof(float));
    float *a = scratch(P * I * sizeof(float)), *down = scratch(P * K * sizeof(float));
    if ((!dot && !xf) || !h || !a || !down) return scratch_release(mark), LS_NO_MEMORY;
    if (!dot)
        for (int64_t i = 0; i < T * K; i++) xf[i] = load_act(x, io & 1, i);
    int64_t units = (K + DOWN_UNIT - 1) / DOWN_UNIT;
#pragma omp parallel num_threads(threads)
    {
        int64_t parts = omp_get_num_threads(), part = omp_get_thread_num(), rows = P * 2 * I;
        for (int64_t r = rows * part / parts; r < rows * (part + 1) / parts; r++) {
            int64_t p = r / (2 * I), j = r - p * 2 * I;
            const char *row = j < I ? (const char *)gate[p] + j * K * wsize : (const char *)up[p] + (j - I) * K * wsize;
            float out[MB];
#ifdef LS_BF16DOT
            if (dot)
                dense_rows_bf16((const uint16_t *)x + (p / count) * K, (const uint16_t *)row, K, 1, out);
            else
#endif
                dense_rows(xf + (p / count) * K, row, wbf, K, 1, out);
            h[r] = out[0];
        }
#pragma omp barrier
#pragma omp single
        for (int64_t p = 0; p < P; p++) silu_mul(h + p * 2 * I, I, a + p * I);
        int64_t c0 = units * part / parts * DOWN_UNIT, c1 = units * (part + 1) / parts * DOWN_UNIT;
        c1 = c1 < K ? c1 : K;
        for (int64_t p = 0; p < P && c0 < c1; p++) {
            float *o = down + p * K;
            for (int64_t i = 0; i < I; i++) {
                const char *row = (const char *)down_t[p] + i * K * wsize;
                vfloat ai = vset1(a[p * I + i]);
                int64_t c = c0;
                if (i == 0) { /* the first row sets the sums: no zeroing pass */
                    for (; c + LANES <= c1; c += LANES) vstore(o + c, vmul(ai, vload(row, wbf, c)));
                    for (; c < c1; c++) o[c] = a[p * I + i] * load_act(row, wbf, c);
                } else {
                    for (; c + LANES <= c1; c += LANES) vstore(o + c, vfma(ai, vload(row, wbf, c), vload(o, 0, c)));
                    for (; c < c1; c++) o[c] += a[p * I + i] * load_act(row, wbf, c);
                }
            }
        }
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t tk = 0; tk < T * K; tk++) {
            int64_t t = tk / K, k = tk - t * K;
            float sum = 0.f;
            for (int64_t p = t * count; p < (t + 1) * count; p++) sum += gates[p] * down[p * K + k];
            store_out(y, io & 2, tk, sum);
        }
    }
    scratch_release(mark);
    return LS_OK;
}

/* A MoE layer's stacked experts for T tokens through `ls_dense_experts`: token t's top-k experts ids[t] (global
 * ids: the stack holds the E experts first..) with gates weights[t] (fp32), in expert order, then the `shared`
 * I-wide chunks of the shared experts with gate 1. w13 `[E, 2I, K]` (gate rows, then up rows) and w2t `[E, I, K]`
 * (down projections transposed) in the weights' dtype (bit 2 of `io`), as are the shared experts' gate sg, up su
 * and transposed down sd `[shared * I, K]`. Returns 1, computing nothing, where an id lies outside the stack,
 * LS_NO_MEMORY where the scratch arena could not grow. */
LS_API int ls_stacked_experts(const void *x, int64_t T, int64_t K, int64_t I, int64_t topk, const int64_t *ids,
                              const float *weights, int64_t first, int64_t E, const void *w13, const void *w2t,
                              int64_t shared, const void *sg, const void *su, const void *sd, void *y, int io,
                              int threads) {
    for (int64_t i = 0; i < T * topk; i++)
        if (ids[i] < first || ids[i] >= first + E) return 1;
    int64_t count = topk + shared, P = T * count, block = I * K * (((io >> 2) & 1) ? 2 : 4);
    ScratchMark mark = scratch_mark();
    const void **gate = scratch(3 * P * sizeof(void *)), **up = gate + P, **down = up + P;
    float *gates = scratch(P * sizeof(float));
    int64_t *order = scratch(topk * sizeof(int64_t));
    if (!gate || !gates || !order) return scratch_release(mark), LS_NO_MEMORY;
    for (int64_t t = 0; t < T; t++) {
        const int64_t *e = ids + t * topk;
        sort_ids(e, topk, order);
        for (int64_t c = 0; c < count; c++) {
            int64_t p = t * count + c;
            if (c < topk) {
                int64_t local = e[order[c]] - first;
                gate[p] = (const char *)w13 + 2 * local * block;
                up[p] = (const char *)w13 + (2 * local + 1) * block;
                down[p] = (const char *)w2t + local * block;
                gates[p] = weights[t * topk + order[c]];
            } else {
                gate[p] = (const char *)sg + (c - topk) * block;
                up[p] = (const char *)su + (c - topk) * block;
                down[p] = (const char *)sd + (c - topk) * block;
                gates[p] = 1.f;
            }
        }
    }
    int bad = ls_dense_experts(x, T, K, I, count, gate, up, down, gates, y, io, threads);
    scratch_release(mark);
    return bad;
}

/* One head's tile of NV vectors of outputs for mb (1 or 2) activation rows: y[i][:] = sum_k x[i][k] * w[k][:],
 * w's rows `stride` elements apart. The tile's accumulators stay in registers; each weight element read once. */
INLINE void heads_tile(const float *x, int64_t xstride, const void *w, int wbf, int64_t K, int64_t stride, int mb,
                       int NV, float *y, int64_t ystride) {
    vfloat acc[2][8];
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < NV; j++) acc[i][j] = vzero();
    for (int64_t k = 0; k < K; k++) {
        vfloat x0 = vset1(x[k]), x1 = mb > 1 ? vset1(x[xstride + k]) : x0;
        for (int j = 0; j < NV; j++) {
            vfloat wv = vload(w, wbf, k * stride + j * LANES);
            acc[0][j] = vfma(x0, wv, acc[0][j]);
            if (mb > 1) acc[1][j] = vfma(x1, wv, acc[1][j]);
        }
    }
    for (int i = 0; i < mb; i++)
        for (int j = 0; j < NV; j++) vstore(y + i * ystride + j * LANES, acc[i][j]);
}

/* MLA's absorbed per-head products for few tokens: y[m, h, n] = sum_k x[m, h, k] * w[h, k, n], w `[H, K, N]` fp32
 * or bf16 (bit 2 of `io`) as bmm takes it, N a multiple of LANES. Tasks of (head, tile of up to 8 vectors of
 * outputs) are shared out among the threads; each streams its tile's K weight rows once for two activation rows
 * (the tile, at most K * 512 bytes, is then read again from the cache for the next two). */
int dense_heads(const void *x, int64_t M, int64_t H, int64_t K, const void *w, int64_t N, void *y, int io,
                int threads) {
    int wbf = (io >> 2) & 1;
    int64_t wsize = wbf ? 2 : 4, nv = N / LANES;
    int tile = nv % 8 == 0 ? 8 : nv % 4 == 0 ? 4 : nv % 2 == 0 ? 2 : 1;
    int64_t tiles = nv / tile;
    ScratchMark mark = scratch_mark();
    float *xf = scratch(M * H * K * sizeof(float)), *yf = scratch(M * H * N * sizeof(float));
    if (!xf || !yf) return scratch_release(mark), LS_NO_MEMORY;
    for (int64_t i = 0; i < M * H * K; i++) xf[i] = load_act(x, io & 1, i);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < H * tiles; t++) {
        int64_t h = t / tiles, n0 = (t % tiles) * tile * LANES;
        const char *wt = (const char *)w + (h * K * N + n0) * wsize;
        for (int64_t m = 0; m < M; m += 2) {
            const float *xm = xf + (m * H + h) * K;
            float *ym = yf + (m * H + h) * N + n0;
#define HEADS_TILE(mb)                                                            \
    switch (tile) {                                                               \
    case 8: heads_tile(xm, H * K, wt, wbf, K, N, mb, 8, ym, H * N); break;        \
    case 4: heads_tile(xm, H * K, wt, wbf, K, N, mb, 4, ym, H * N); break;        \
    case 2: heads_tile(xm, H * K, wt, wbf, K, N, mb, 2, ym, H * N); break;        \
    default: heads_tile(xm, H * K, wt, wbf, K, N, mb, 1, ym, H * N); break;       \
    }
            if (M - m >= 2) {
                HEADS_TILE(2)
            } else {
                HEADS_TILE(1)
            }
#undef HEADS_TILE
        }
    }
    for (int64_t i = 0; i < M * H * N; i++) store_out(y, io & 2, i, yf[i]);
    scratch_release(mark);
    return LS_OK;
}
