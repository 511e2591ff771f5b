/* The drivers of the quantized formats (quant.h's Format: int8 in `pack_int8`'s layout, int4 in `pack_int4`'s):
 * a linear layer at any row count, and a few tokens' routed experts whose gate_up and down may each have their own
 * format (llama.cpp's Q4_K_M files keep some down projections at 8 bits beside 4-bit gate and up). Both walk
 * blocks of 16 outputs, each block one stream of bytes read once for all the rows it meets; what differs between
 * formats is the format's own business (block_bytes, quantize_for, block_dots). */
#include "quant.h"

#define ROW_CHUNK 256 /* activation rows a pass over the weight: their int8 (512 KB at K = 2048) stay in L2 */
#define PAIR_ROWS 8    /* up to this many rows int8 reads two blocks at once (int8_block_pair_dots) */

/* y[m0 .. m0 + rows, block b's outputs] = dots[16 * m + j]. */
static void store_block(void *y, int bf16, int64_t N, int64_t m0, int64_t rows, int64_t b, const float *dots) {
    int64_t outputs = N - 16 * b < 16 ? N - 16 * b : 16;
    for (int64_t m = 0; m < rows; m++)
        for (int64_t j = 0; j < outputs; j++) store_out(y, bf16, (m0 + m) * N + 16 * b + j, dots[16 * m + j]);
}

/* ls_int8_linear and ls_int4_linear: y[M, N] = x[M, K] @ dequantized(w)[N, K]^T for w in format (bits, G). Each
 * thread a contiguous share of the blocks. A few rows are bound by reading the weight, and one stream of it a
 * thread keeps too few reads in flight: int8 up to PAIR_ROWS rows reads two blocks at once, the i-th of each half of
 * the share (int8_block_pair_dots). Against walking the blocks in order, same run, interleaved call by call, timed by
 * CPU time on a loaded machine (2026-12-05, benchmarks/RESULTS.md "Weight streaming"): 1.04-1.28x faster at 1-2 rows
 * and 1.14-1.7x at 4-8 on V2-Lite/V3 shapes and lm_head. An earlier measurement under load, by wall time and whole
 * blocks alternating (`two_streams`), had found two streams up to 1.2x slower; wall time under that load mostly
 * measured the other processes. More rows are bound by the arithmetic and walk the blocks in order, as int4 does
 * at every row count (at one row it streams at 72-114 % of the copy bandwidth). Above ROW_CHUNK rows, ROW_CHUNK rows
 * a pass. Each row's result is the same whatever rows it is computed with, and whatever the thread count. */
int quant_linear(const void *x, int64_t M, int64_t K, const void *w, int bits, int64_t G, int64_t N, void *y,
                 int io, int threads) {
    Format f = {bits, G};
    int64_t blocks = (N + 15) / 16, bytes = block_bytes(f, K), per = (M < ROW_CHUNK ? M : ROW_CHUNK) * 16;
    ScratchMark mark = scratch_mark();
    QuantActs a = quantize_for(f, x, io & 1, M, K);
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
            if (bits == 8 && rows <= PAIR_ROWS) {
                for (int64_t b = begin; b < begin + half; b++) {
                    if (b + half < begin + len) {
                        int8_block_pair_dots(a, m0, rows, (const int8_t *)(wb + b * bytes),
                                             (const int8_t *)(wb + (b + half) * bytes), K, mine, other);
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

/* The experts' pairs grouped by expert (groups of them, pairs start[g] .. start[g + 1]; order[i]: the i-th pair's
 * position in `weights`, two pointers each: gate_up, down). */
typedef struct {
    int64_t groups;
    const int64_t *start, *order;
    void *const *weights;
} ExpertGroups;

/* This thread's share of one layer (which: 0 gate_up, 1 down, in format f) of every group: `rows` outputs from K
 * inputs in blocks of 16, dst[pair, rows] = the pair's outputs. Each pair's arithmetic is the same whatever pairs
 * share its expert. */
static void expert_layer(ExpertGroups e, int which, Format f, QuantActs a, int64_t rows, int64_t K, float *dots,
                         float *dst) {
    int64_t units = (rows + 15) / 16, total = e.groups * units, bytes = block_bytes(f, K);
    int64_t parts = omp_get_num_threads(), part = omp_get_thread_num();
    for (int64_t begin = total * part / parts, len = total * (part + 1) / parts - begin, idx = 0; idx < len; idx++) {
        int64_t r = begin + idx, g = r / units, u = r - g * units; /* in order, as ls_quant_linear */
        int64_t first = e.start[g], m = e.start[g + 1] - first, outputs = rows - u * 16 < 16 ? rows - u * 16 : 16;
        const char *w = e.weights[2 * e.order[first] + which];
        block_dots(f, a, first, m, w + u * bytes, K, dots);
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = 0; j < outputs; j++) dst[(first + i) * rows + u * 16 + j] = dots[i * 16 + j];
    }
}

/* T tokens, each through `count` routed experts: y[t] = sum_j gates[t, j] * down_j(silu(gate_j(x[t])) * up_j(x[t]))
 * in the order given, in one parallel region. Per expert, `weights` holds two pointers: its gate and up as one fused
 * weight of 2 * I rows (gate's first) in format (bits, G), its down projection in format (down_bits, GD). x is
 * quantized once per token. The (token, expert) pairs are grouped by expert, so an expert that several tokens chose
 * is read once for all of them; every pair's arithmetic is the same as for its token alone, so each token's result
 * does not depend on the batch around it. */
LS_API int ls_experts_tokens(const void *x, int64_t T, int64_t K, int64_t I, int64_t count, void *const *weights,
                             const float *gates, int bits, int64_t G, int down_bits, int64_t GD, void *y, int io,
                             int threads) {
    Format gate_up = {bits, G}, down = {down_bits, GD};
    int64_t P = T * count, groups = 0;
    ScratchMark mark = scratch_mark();
    int64_t *order = scratch(P * sizeof(int64_t)), *slot = scratch(P * sizeof(int64_t));
    int64_t *start = scratch((P + 1) * sizeof(int64_t)), *token = scratch(P * sizeof(int64_t));
    float *h = scratch(P * 2 * I * sizeof(float)), *a = scratch(P * I * sizeof(float));
    float *o = scratch(P * K * sizeof(float));
    float *dots = scratch(threads * 16 * P * sizeof(float)); /* per thread: an expert's pairs, 16 outputs each */
    QuantActs aa = take_acts(P, I, down_bits, GD); /* filled in the region by whichever thread runs the single */
    if (!order || !slot || !start || !token || !h || !a || !o || !dots || !aa.q)
        return scratch_release(mark), LS_NO_MEMORY;
    for (int64_t p = 0; p < P; p++) { /* insertion sort of the pairs by expert, stable */
        int64_t j = p;
        for (; j > 0 && (uintptr_t)weights[order[j - 1] * 2] > (uintptr_t)weights[p * 2]; j--) order[j] = order[j - 1];
        order[j] = p;
    }
    for (int64_t i = 0; i < P; i++) {
        slot[order[i]] = i;
        if (i == 0 || weights[order[i] * 2] != weights[order[i - 1] * 2]) start[groups++] = i;
    }
    start[groups] = P;
    for (int64_t i = 0; i < P; i++) token[i] = order[i] / count; /* each pair's token, in grouped order */
    QuantActs xt = quantize_for(gate_up, x, io & 1, T, K), xa = xt.q ? gather_acts(xt, token, P, K, bits, G) : xt;
    if (!xa.q) return scratch_release(mark), LS_NO_MEMORY;
    ExpertGroups e = {groups, start, order, weights};
#pragma omp parallel num_threads(threads)
    {
        float *mine = dots + omp_get_thread_num() * 16 * P;
        expert_layer(e, 0, gate_up, xa, 2 * I, K, mine, h);
#pragma omp barrier
#pragma omp single
        {
            for (int64_t i = 0; i < P; i++) silu_mul(h + i * 2 * I, I, a + i * I);
            quantize_into(a, 0, P, I, down_bits, GD, aa);
        }
        expert_layer(e, 1, down, aa, K, I, mine, o);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t tk = 0; tk < T * K; tk++) {
            int64_t t = tk / K, k = tk - t * K;
            float sum = 0.f;
            for (int64_t j = 0; j < count; j++) sum += gates[t * count + j] * o[slot[t * count + j] * K + k];
            store_out(y, io & 2, tk, sum);
        }
    }
    scratch_release(mark);
    return LS_OK;
}
