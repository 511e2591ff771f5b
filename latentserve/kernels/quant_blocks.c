/* The driver of the quantized formats' linear layers (quant.h's Format: int8 in `pack_int8`'s layout, int4 in
 * `pack_int4`'s, Q6_K in `pack_q6k`'s) at any row count (the experts' driver: experts.c). It walks blocks of 16
 * outputs, each block one stream of bytes read once for all the rows it meets; what differs between formats is the
 * format's own business (block_bytes, quantize_for, block_dots). */
#include "quant.h"

/* Activation rows a pass over the weight: their int8 (512 KB at K = 2048; AVX2's nibbles, int8_row_bytes, twice
 * that) stay in L2; past a K of a few thousand (a dense MLP's down projection) they do not. */
#define ROW_CHUNK 256

int64_t read_ahead; /* quant.h's; 0 until the loader sets it */

LS_API void ls_set_read_ahead(int64_t bytes) { read_ahead = bytes > 0 ? bytes : 0; }

/* y[m0 .. m0 + rows, block b's outputs] = dots[16 * m + j]. */
static void store_block(void *y, int bf16, int64_t N, int64_t m0, int64_t rows, int64_t b, const float *dots) {
    int64_t outputs = N - 16 * b < 16 ? N - 16 * b : 16;
    for (int64_t m = 0; m < rows; m++)
        for (int64_t j = 0; j < outputs; j++) store_out(y, bf16, (m0 + m) * N + 16 * b + j, dots[16 * m + j]);
}

/* The quantized linear entry points: y[M, N] = x[M, K] @ dequantized(w)[N, K]^T for w in format f. Each thread a
 * contiguous share of the blocks. A few rows are bound by reading the weight, and one stream of it a thread keeps too
 * few reads in flight: up to PAIR_ROWS rows it reads two blocks at once, the i-th of each half of the share
 * (block_pair_dots). Against walking the blocks in order, same run, interleaved call by call, timed by CPU time on a
 * loaded machine (2026-12-05, benchmarks/RESULTS.md "Weight streaming"): int8 1.04-1.28x faster at 1-2 rows and
 * 1.14-1.7x at 4-8 on V2-Lite/V3 shapes and lm_head; int4 (2816 x 2048, group 32) 1.2-1.3x at 1 row, 1.3-1.45x at 4. An
 * earlier measurement under load, by wall time and whole blocks alternating (`two_streams`), had found two streams up
 * to 1.2x slower; wall time under that load mostly measured the other processes. More rows are bound by the arithmetic
 * and walk the blocks in order, but for int8 on AMX tiles (pairs()), which pass two blocks at a time on the same rows
 * (amx.c). Above ROW_CHUNK rows, ROW_CHUNK rows a pass. Each row's result is the same whatever rows it is computed
 * with, and whatever the thread count. */
int quant_linear(const void *x, int64_t M, int64_t K, const void *w, Format f, int64_t N, void *y, int io,
                 int threads) {
    int64_t blocks = (N + 15) / 16, bytes = block_bytes(f, K), per = (M < ROW_CHUNK ? M : ROW_CHUNK) * 16;
    ScratchMark mark = scratch_mark();
    QuantActs a = quantize_for(f, x, io & 1, M, K, threads);
    float *dots = scratch(threads * 2 * per * sizeof(float)); /* each thread's slice: the arena is the caller's */
    if (!a.q || !dots) return scratch_release(mark), LS_NO_MEMORY;
    const char *wb = w;
#pragma omp parallel num_threads(threads)
    {
        float *mine = dots + omp_get_thread_num() * 2 * per, *other = mine + per;
        int64_t parts = omp_get_num_threads(), part = omp_get_thread_num(), begin = blocks * part / parts;
        int64_t len = blocks * (part + 1) / parts - begin, half = (len + 1) / 2;
        for (int64_t m0 = 0; m0 < M; m0 += ROW_CHUNK) {
            int64_t rows = M - m0 < ROW_CHUNK ? M - m0 : ROW_CHUNK;
            if (pairs(f, rows)) {
                for (int64_t b = begin; b < begin + half; b++) {
                    if (b + half < begin + len) {
                        block_pair_dots(f, a, m0, a, m0, rows, wb + b * bytes, wb + (b + half) * bytes, K, mine, other);
                        store_block(y, io & 2, N, m0, rows, b + half, other);
                    } else {
                        block_dots(f, a, m0, rows, wb + b * bytes, K, mine);
                    }
                    store_block(y, io & 2, N, m0, rows, b, mine);
                }
            } else {
                for (int64_t b = begin; b < begin + len; b++) {
                    block_dots(f, a, m0, rows, wb + b * bytes, K, mine);
                    store_block(y, io & 2, N, m0, rows, b, mine);
                }
            }
        }
    }
    scratch_release(mark);
    return LS_OK;
}
