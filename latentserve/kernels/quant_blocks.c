/* The driver of the quantized formats' linear layers (quant.h's Format: int8 in `pack_int8`'s layout, int4 in
 * `pack_int4`'s) at any row count (the experts' driver: experts.c). It walks blocks of 16 outputs, each block one
 * stream of bytes read once for all the rows it meets; what differs between formats is the format's own business
 * (block_bytes, quantize_for, block_dots). */
#include "quant.h"

#define ROW_CHUNK 256 /* activation rows a pass over the weight: their int8 (512 KB at K = 2048) stay in L2 */

/* ls_int8_linear and ls_int4_linear: y[M, N] = x[M, K] @ dequantized(w)[N, K]^T for w in format (bits, G). Each thread a contiguous share of the blocks,
 * in order: a block is already a long stream (16 K bytes in int8), and alternating two halves of the share
 * (`two_streams`, which helps rows of a few KB) measured up to 1.2x slower at one row (benchmarks/RESULTS.md).
 * Above ROW_CHUNK rows, ROW_CHUNK rows a pass. Each row's result is the same whatever rows it is computed with. */
int quant_linear(const void *x, int64_t M, int64_t K, const void *w, int bits, int64_t G, int64_t N, void *y,
                 int io, int threads) {
    Format f = {bits, G};
    int64_t blocks = (N + 15) / 16, bytes = block_bytes(f, K), per = (M < ROW_CHUNK ? M : ROW_CHUNK) * 16;
    ScratchMark mark = scratch_mark();
    QuantActs a = quantize_for(f, x, io & 1, M, K);
    float *dots = scratch(threads * per * sizeof(float)); /* each thread's slice: the arena is the caller's */
    if (!a.q || !dots) return scratch_release(mark), LS_NO_MEMORY;
#pragma omp parallel num_threads(threads)
    {
        float *mine = dots + omp_get_thread_num() * per;
        for (int64_t m0 = 0; m0 < M; m0 += ROW_CHUNK) {
            int64_t rows = M - m0 < ROW_CHUNK ? M - m0 : ROW_CHUNK;
            for (int64_t parts = omp_get_num_threads(), part = omp_get_thread_num(), begin = blocks * part / parts,
                         len = blocks * (part + 1) / parts - begin, idx = 0; idx < len; idx++) {
                int64_t b = begin + idx, outputs = N - 16 * b < 16 ? N - 16 * b : 16;
                block_dots(f, a, m0, rows, (const char *)w + b * bytes, K, mine);
                for (int64_t m = 0; m < rows; m++)
                    for (int64_t j = 0; j < outputs; j++)
                        store_out(y, io & 2, (m0 + m) * N + 16 * b + j, mine[16 * m + j]);
            }
        }
    }
    scratch_release(mark);
    return LS_OK;
}
