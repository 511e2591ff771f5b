/* RMSNorm per row, in fp32: y = x / sqrt(mean(x^2) + eps) * w. With bf16 x and w the normalized row is rounded to
 * bf16 before the weight multiplies it, as DeepSeek's reference does; y in x's dtype. One call instead of the half
 * dozen small ops of a composite norm: decode norms a row of a few thousand values, where each op costs more than
 * the arithmetic. */
#include "simd.h"

void rms_norm_row(const void *x, int xbf, int64_t N, const void *w, int wbf, float eps, void *y, int ybf) {
    vfloat acc = vzero();
    int64_t k = 0;
    for (; k + LANES <= N; k += LANES) {
        vfloat v = vload(x, xbf, k);
        acc = vfma(v, v, acc);
    }
    float squares = vreduce_add(acc);
    for (; k < N; k++) squares += load_act(x, xbf, k) * load_act(x, xbf, k);
    float r = 1.f / sqrtf(squares / (float)N + eps);
    vfloat vr = vset1(r);
    for (k = 0; k + LANES <= N; k += LANES) { /* the scalar loop's operations, LANES at a time: the same bits */
        vfloat v = vmul(vload(x, xbf, k), vr);
        if (xbf) v = vround_bf16(v);
        vstore_out(y, ybf, k, vmul(v, vload(w, wbf, k)));
    }
    for (; k < N; k++) {
        float v = load_act(x, xbf, k) * r;
        if (xbf) v = bf16_to_float(float_to_bf16(v));
        store_out(y, ybf, k, v * load_act(w, wbf, k));
    }
}

/* `io`: bit 0 x and y are bf16, bit 2 w is (else fp32). Rows are shared out among the threads from 16 rows on. */
void rms_norm(const void *x, int64_t M, int64_t N, const void *w, float eps, void *y, int io, int threads) {
    int xbf = io & 1, wbf = (io >> 2) & 1;
    int64_t size = xbf ? 2 : 4;
#pragma omp parallel for num_threads(threads) if (M >= 16) schedule(static)
    for (int64_t m = 0; m < M; m++)
        rms_norm_row((const char *)x + m * N * size, xbf, N, w, wbf, eps, (char *)y + m * N * size, xbf);
}
