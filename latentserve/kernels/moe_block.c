/* A decode step's whole MoE block in one call: y = residual + moe(x) for a few tokens x (the post-attention norm's
 * output): the router's fp32 product, the routing, the routed experts and the shared ones, chaining the kernels the
 * modules call one by one (gemv.c's fp32 product, route.c, experts.c's routed and shared experts) with the same
 * arguments in the same order, and rounding the sums where torch's adds round them, so the result equals theirs to
 * the bit wherever they run those kernels (each token's result the same as alone).
 * It saves the ~20 Python calls and small torch ops of an MoE layer, which cost more than the routing arithmetic and
 * a fifth of a quantized V2-Lite decode step. Activations are all fp32 or all bf16 (`bf`). */
#include "simd.h"

/* The block's MLP for each token: the routed experts the router chooses and the shared ones; with no routed experts
 * (a dense layer's MLP as its `shared`), that MLP alone, as the experts kernel runs a one-expert table at weight 1
 * (what the dense layer's module calls for one token: layers/quant/experts.py tokens_mlp). */
static int mlp(const MoEBlock *b, const void *x, int64_t T, float *logits, float *weights, int64_t *ids, void *out,
               int threads) {
    int64_t E = b->experts, k = b->topk, K = b->hidden;
    int io = b->bf ? 0b11 : 0;
    if (!E) {
        for (int64_t t = 0; t < T; t++) ids[t] = 0, weights[t] = 1.f;
        return experts(&b->shared, NULL, x, T, K, 1, ids, weights, out, io, threads);
    }
    int bad = dense_linear(x, T, K, b->router, E, logits, b->bf, threads); /* fp32 weight and logits */
    if (!bad)
        bad = route(logits, T, E, k, b->sigmoid, b->groups, b->topk_groups, b->bias, b->norm, b->scaling, weights,
                    ids);
    return bad ? bad : experts(&b->routed, &b->shared, x, T, K, k, ids, weights, out, io, threads);
}

/* Returns LS_BAD_EXPERT (nothing written) where the routing chose an expert the table does not hold, LS_NO_MEMORY
 * where the scratch arena could not grow. */
int moe_block(const MoEBlock *b, const void *x, const void *residual, int64_t T, void *y, int threads) {
    int64_t k = b->experts ? b->topk : 1, K = b->hidden, size = b->bf ? 2 : 4;
    ScratchMark mark = scratch_mark();
    float *logits = scratch(T * b->experts * sizeof(float)), *weights = scratch(T * k * sizeof(float));
    int64_t *ids = scratch(T * k * sizeof(int64_t));
    char *moe = scratch(T * K * size);
    int bad = !logits || !weights || !ids || !moe ? LS_NO_MEMORY : LS_OK;
    if (!bad) bad = mlp(b, x, T, logits, weights, ids, moe, threads);
    if (!bad)
        for (int64_t i = 0; i < T * K; i++) /* the residual, rounded as torch's add rounds it */
            store_out(y, b->bf, i, load_act(residual, b->bf, i) + load_act(moe, b->bf, i));
    scratch_release(mark);
    return bad;
}
