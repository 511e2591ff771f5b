/* A decode step's whole MoE block in one call: y = residual + moe(x) for a few tokens x (the post-attention norm's
 * output): the router's fp32 product, the routing, the routed experts and the shared ones, chaining the kernels the
 * modules call one by one (gemv.c's fp32 product, route.c, the stacked or quantized experts) with the same arguments
 * in the same order, and rounding the sums where torch's adds round them, so the result equals theirs to the bit
 * wherever they run those kernels (quantized experts: one token; several go through the same kernel here, each
 * token's result the same as alone).
 * It saves the ~20 Python calls and small torch ops of an MoE layer, which cost more than the routing arithmetic and
 * a fifth of a quantized V2-Lite decode step. Activations are all fp32 or all bf16 (`bf`). */
#include "simd.h"

/* Tokens through their quantized routed experts (each token's in expert order, as the modules sort them) and the
 * shared MLP: each rounded to the activations' dtype, then their sum, as torch adds the two. */
static int quantized_tokens(const MoEBlock *b, const void *x, int64_t T, const float *weights, const int64_t *ids,
                            void *out, int threads) {
    int per = 2, io = b->bf ? 0b11 : 0; /* per expert: its packed gate_up and down */
    int64_t k = b->topk, K = b->hidden, size = b->bf ? 2 : 4;
    void **chosen = scratch(T * k * per * sizeof(void *)), **shared = scratch(T * per * sizeof(void *));
    float *gates = scratch(T * k * sizeof(float)), *ones = scratch(T * sizeof(float));
    int64_t *order = scratch(k * sizeof(int64_t));
    char *y = scratch(T * K * size);
    if (!chosen || !shared || !gates || !ones || !order || !y) return LS_NO_MEMORY;
    for (int64_t t = 0; t < T; t++) {
        const int64_t *e = ids + t * k;
        sort_ids(e, k, order);
        for (int64_t c = 0; c < k; c++) {
            gates[t * k + c] = weights[t * k + order[c]];
            memcpy(chosen + (t * k + c) * per, b->table + e[order[c]] * per, per * sizeof(void *));
        }
    }
    int bad = ls_experts_tokens(x, T, K, b->inter, k, chosen, gates, b->bits[0], b->group[0], b->bits[1], b->group[1],
                                out, io, threads);
    if (!bad && b->shared) {
        for (int64_t t = 0; t < T; t++) {
            memcpy(shared + t * per, b->shared, per * sizeof(void *));
            ones[t] = 1.f;
        }
        bad = ls_experts_tokens(x, T, K, b->shared_inter, 1, shared, ones, b->shared_bits[0], b->shared_group[0],
                                b->shared_bits[1], b->shared_group[1], y, io, threads);
        for (int64_t i = 0; !bad && i < T * K; i++)
            store_out(out, b->bf, i, load_act(out, b->bf, i) + load_act(y, b->bf, i));
    }
    return bad;
}

/* Returns LS_BAD_EXPERT (nothing written) where the stacked experts' kernel refuses the chosen ids, LS_NO_MEMORY
 * where the scratch arena could not grow. */
int moe_block(const MoEBlock *b, const void *x, const void *residual, int64_t T, void *y, int threads) {
    int64_t E = b->experts, k = b->topk, K = b->hidden, size = b->bf ? 2 : 4;
    ScratchMark mark = scratch_mark();
    float *logits = scratch(T * E * sizeof(float)), *weights = scratch(T * k * sizeof(float));
    int64_t *ids = scratch(T * k * sizeof(int64_t));
    char *moe = scratch(T * K * size);
    int bad = !logits || !weights || !ids || !moe ? LS_NO_MEMORY : LS_OK;
    if (!bad) bad = dense_linear(x, T, K, b->router, E, logits, b->bf, threads); /* fp32 weight and logits */
    if (!bad)
        bad = route(logits, T, E, k, b->sigmoid, b->groups, b->topk_groups, b->bias, b->norm, b->scaling, weights,
                    ids);
    if (!bad && b->bits[0]) {
        bad = quantized_tokens(b, x, T, weights, ids, moe, threads);
    } else if (!bad) {
        bad = ls_stacked_experts(x, T, K, b->inter, k, ids, weights, 0, E, b->w13, b->w2t, b->shared_chunks, b->sg,
                                 b->su, b->sd, moe, b->bf ? 0b111 : 0, threads);
        bad = bad == 1 ? LS_BAD_EXPERT : bad;
    }
    if (!bad)
        for (int64_t i = 0; i < T * K; i++) /* the residual, rounded as torch's add rounds it */
            store_out(y, b->bf, i, load_act(residual, b->bf, i) + load_act(moe, b->bf, i));
    scratch_release(mark);
    return bad;
}
