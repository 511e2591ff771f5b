/* Two quantized linear layers over one input in one parallel region: MLA's q_a and kv_a, which both read the
 * normed x. Called one after the other they cost a parallel region each (its start, its closing barrier) and
 * kv_a's small matrix (1.2 MB at V3's shapes) a fresh ramp-up of the hardware prefetchers after q_a's stream has
 * stopped. Here the two weights' blocks of 16 outputs are one list, shared out among the threads as quant_linear
 * shares one weight's (a contiguous share each, blocks of up to PAIR_ROWS rows read two at a time, the i-th of
 * each half of the share), so both streams run from the first cycle to the last. Each block's outputs are the
 * same dot products quant_linear computes (block_pair_dots equals block_dots), so the results equal the
 * two calls' to the bit, whatever the thread count. */
#include "quant.h"

/* One of the two layers: its format, outputs, packed weight, output [M, N] and the activations for its format. */
typedef struct {
    Format f;
    int64_t N, blocks, bytes;
    const char *w;
    void *y;
    QuantActs a;
} Layer;

/* The block list's b-th entry: its layer and its index there. */
INLINE const Layer *entry(const Layer *l, int64_t b, int64_t *index) {
    int second = b >= l[0].blocks;
    *index = second ? b - l[0].blocks : b;
    return l + second;
}

INLINE void store_block(const Layer *l, int bf16, int64_t M, int64_t b, const float *dots) {
    int64_t outputs = l->N - 16 * b < 16 ? l->N - 16 * b : 16;
    for (int64_t m = 0; m < M; m++)
        for (int64_t j = 0; j < outputs; j++) store_out(l->y, bf16, m * l->N + 16 * b + j, dots[16 * m + j]);
}

/* Block b of the list, and block `other` (< 0: none) beside it: where both are of one format and the rows few,
 * read at once (block_pair_dots: two streams of weights in flight). */
static void run_blocks(const Layer *l, int64_t M, int64_t K, int bf16, int64_t b, int64_t other, float *mine,
                       float *theirs) {
    int64_t i, j;
    const Layer *p = entry(l, b, &i), *q = other < 0 ? NULL : entry(l, other, &j);
    if (q && p->f.bits == q->f.bits && p->f.group == q->f.group && M <= PAIR_ROWS) {
        block_pair_dots(p->f, p->a, 0, q->a, 0, M, p->w + i * p->bytes, q->w + j * q->bytes, K, mine, theirs);
    } else {
        block_dots(p->f, p->a, 0, M, p->w + i * p->bytes, K, mine);
        if (q) block_dots(q->f, q->a, 0, M, q->w + j * q->bytes, K, theirs);
    }
    store_block(p, bf16, M, i, mine);
    if (q) store_block(q, bf16, M, j, theirs);
}

/* y0 [M, N0] = x [M, K] @ w0^T and y1 [M, N1] = x @ w1^T, each w in quant_linear's formats (bits 8: pack_int8's
 * layout, 4: pack_int4's with group G); `io` as quant_linear's. For a few rows (decode): the activations of both
 * stay in cache for all the blocks. */
int quant_linear_pair(const void *x, int64_t M, int64_t K, const void *w0, int bits0, int64_t G0, int64_t N0,
                      void *y0, const void *w1, int bits1, int64_t G1, int64_t N1, void *y1, int io, int threads) {
    Layer l[2] = {{{bits0, G0}, N0, (N0 + 15) / 16, 0, w0, y0, {0}}, {{bits1, G1}, N1, (N1 + 15) / 16, 0, w1, y1, {0}}};
    ScratchMark mark = scratch_mark();
    for (int k = 0; k < 2; k++) {
        l[k].bytes = block_bytes(l[k].f, K);
        int same = k == 1 && l[1].f.bits == l[0].f.bits && l[1].f.group == l[0].f.group;
        l[k].a = same ? l[0].a : quantize_for(l[k].f, x, io & 1, M, K, threads); /* one format: x quantized once */
    }
    int64_t blocks = l[0].blocks + l[1].blocks, per = 16 * M;
    float *dots = scratch(threads * 2 * per * sizeof(float)); /* each thread's slice: the arena is the caller's */
    if (!l[0].a.q || !l[1].a.q || !dots) return scratch_release(mark), LS_NO_MEMORY;
#pragma omp parallel num_threads(threads)
    {
        float *mine = dots + omp_get_thread_num() * 2 * per;
        int64_t parts = omp_get_num_threads(), part = omp_get_thread_num(), begin = blocks * part / parts;
        int64_t len = blocks * (part + 1) / parts - begin, half = (len + 1) / 2;
        for (int64_t b = begin; b < begin + half; b++)
            run_blocks(l, M, K, io & 2, b, b + half < begin + len ? b + half : -1, mine, mine + per);
    }
    scratch_release(mark);
    return LS_OK;
}
