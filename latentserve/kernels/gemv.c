/* fp32 and bf16 products for few rows (decode), fp32 sums: linear layers y[M, N] = x[M, K] @ w[N, K]^T, the
 * dense format's blocks of the experts' driver (experts.c), and MLA's absorbed per-head products.
 *
 * Each thread walks its share of w's rows, one row at a time, all activation rows against it: one stream of
 * weights per thread, every weight read once. PyTorch's products leave bandwidth unused at these shapes: MKL runs
 * a one-row fp32 product on one thread, oneDNN's one-row bf16 product reads ~15 GB/s on two.
 */
#include "quant.h"

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

/* quant.h's dense format: the block's first `outputs` rows of K weights (bf16 where wbf) against rows first..
 * first + m of `a`, into dots[16 * i + j]. One weight row at a time, every activation row against it, as
 * dense_linear. */
void dense_block_dots(QuantActs a, int64_t first, int64_t m, const void *block, int wbf, int64_t K, int64_t outputs,
                      float *dots) {
    int64_t wsize = wbf ? 2 : 4;
    for (int64_t j = 0; j < outputs; j++) {
        const void *row = (const char *)block + j * K * wsize;
        for (int64_t m0 = 0; m0 < m; m0 += MB) {
            int mb = m - m0 < MB ? (int)(m - m0) : MB;
            float out[MB];
#ifdef LS_BF16DOT
            if (a.bf16)
                FOR_ROWS(dense_rows_bf16, (const uint16_t *)a.rows + (first + m0) * K, (const uint16_t *)row, K)
            else
#endif
                FOR_ROWS(dense_rows, (const float *)a.rows + (first + m0) * K, row, wbf, K)
            for (int i = 0; i < mb; i++) dots[16 * (m0 + i) + j] = out[i];
        }
    }
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
