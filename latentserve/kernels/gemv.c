/* fp32 and bf16 linear layers for few rows (decode): y[M, N] = x[M, K] @ w[N, K]^T, fp32 sums.
 *
 * Each thread walks its share of w's rows, one row at a time, all activation rows against it: one stream of
 * weights per thread, every weight read once. PyTorch's products leave bandwidth unused at these shapes: MKL runs
 * a one-row fp32 product on one thread, oneDNN's one-row bf16 product reads ~15 GB/s on two.
 */
#include "simd.h"

/* dot[i] = x[i] . w over K columns, x fp32 (rows K apart), w fp32 or bf16. */
INLINE void dense_rows(const float *x, const void *w, int wbf, int64_t K, int mb, float dot[MB]) {
    vfloat acc[MB];
    for (int i = 0; i < mb; i++) acc[i] = vzero();
    int64_t k = 0;
    for (; k + LANES <= K; k += LANES) {
        vfloat wv = vload(w, wbf, k);
        for (int i = 0; i < mb; i++) acc[i] = vfma(vload(x + i * K, 0, k), wv, acc[i]);
    }
    for (int i = 0; i < mb; i++) {
        float d = vreduce_add(acc[i]);
        for (int64_t t = k; t < K; t++) d += x[i * K + t] * load_act(w, wbf, t);
        dot[i] = d;
    }
}

/* `io`: bit 0 x is bf16, bit 1 y, bit 2 w (else fp32). */
void ls_dense_linear(const void *x, int64_t M, int64_t K, const void *w, int64_t N, void *y, int io, int threads) {
    int wbf = (io >> 2) & 1;
    int64_t wsize = wbf ? 2 : 4;
    float *xf = malloc(M * K * sizeof(float));
    for (int64_t i = 0; i < M * K; i++) xf[i] = load_act(x, io & 1, i);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const void *row = (const char *)w + n * K * wsize;
        for (int64_t m0 = 0; m0 < M; m0 += MB) {
            int mb = M - m0 < MB ? (int)(M - m0) : MB;
            float out[MB];
            FOR_ROWS(dense_rows, xf + m0 * K, row, wbf, K)
            for (int i = 0; i < mb; i++) store_out(y, io & 2, (m0 + i) * N + n, out[i]);
        }
    }
    free(xf);
}
