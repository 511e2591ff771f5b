/* A decode step's whole MoE block in one call: y = residual + moe(x) for a few tokens x (the post-attention norm's
 * output): the router's fp32 product, the routing, the routed experts and the shared ones, chaining the kernels the
 * modules call one by one (gemv.c's fp32 product, route.c, the stacked or quantized experts) with the same arguments
 * in the same order, and rounding the sums where torch's adds round them, so the result equals theirs to the bit
 * wherever they run those kernels (quantized experts: one token; several go through the same kernel here, each
 * token's result the same as alone).
 * It saves the ~20 Python calls and small torch ops of an MoE layer, which cost more than the routing arithmetic and
 * a fifth of a quantized V2-Lite decode step. Activations are all fp32 or all bf16 (`bf`). */
#include "simd.h"

/* One layer's MoE as the kernels read it. Stacked fp32/bf16 experts (bits[0] 0) as StackedExperts holds them (w13
 * [E, 2I, K], w2t [E, I, K]), the shared ones folded in as `shared_chunks` more experts (sg, su, sd) or none; or
 * quantized experts (quant.h's formats: gate_up's bits and group size in bits[0], group[0], down's in bits[1],
 * group[1]), two pointers each in `table` (the packed gate_up and down), the shared MLP as one more such expert of
 * `shared_inter` in its own formats (shared_bits, shared_group) or NULL. */
typedef struct {
    int64_t hidden, experts, topk, groups, topk_groups;
    int32_t sigmoid, norm;
    float scaling;
    const float *router, *bias;
    int32_t bf;
    int64_t inter;
    const void *w13, *w2t;
    int64_t shared_chunks;
    const void *sg, *su, *sd;
    void *const *table, *const *shared;
    int32_t bits[2], shared_bits[2];
    int64_t group[2], shared_group[2], shared_inter;
} MoEBlock;

/* Tokens through their quantized routed experts (each token's in expert order, as the modules sort them) and the
 * shared MLP: each rounded to the activations' dtype, then their sum, as torch adds the two. */
static void quantized_tokens(const MoEBlock *b, const void *x, int64_t T, const float *weights, const int64_t *ids,
                             void *out, int threads) {
    int io = b->bf ? 0b11 : 0;
    int64_t k = b->topk, K = b->hidden, size = b->bf ? 2 : 4;
    void **chosen = malloc(T * k * 2 * sizeof(void *));
    float *gates = malloc(T * k * sizeof(float));
    int64_t *order = malloc(k * sizeof(int64_t));
    for (int64_t t = 0; t < T; t++) {
        const int64_t *e = ids + t * k;
        sort_ids(e, k, order);
        for (int64_t c = 0; c < k; c++) {
            gates[t * k + c] = weights[t * k + order[c]];
            memcpy(chosen + (t * k + c) * 2, b->table + e[order[c]] * 2, 2 * sizeof(void *));
        }
    }
    ls_experts_tokens(x, T, K, b->inter, k, chosen, gates, b->bits[0], b->group[0], b->bits[1], b->group[1], out, io,
                      threads);
    if (b->shared) {
        void **shared = malloc(T * 2 * sizeof(void *));
        float *ones = malloc(T * sizeof(float));
        char *y = malloc(T * K * size);
        for (int64_t t = 0; t < T; t++) {
            memcpy(shared + t * 2, b->shared, 2 * sizeof(void *));
            ones[t] = 1.f;
        }
        ls_experts_tokens(x, T, K, b->shared_inter, 1, shared, ones, b->shared_bits[0], b->shared_group[0],
                          b->shared_bits[1], b->shared_group[1], y, io, threads);
        for (int64_t i = 0; i < T * K; i++)
            store_out(out, b->bf, i, load_act(out, b->bf, i) + load_act(y, b->bf, i));
        free(shared), free(ones), free(y);
    }
    free(chosen), free(gates), free(order);
}

/* Returns 1 (nothing written) where the stacked experts' kernel refuses the chosen ids. */
LS_API int ls_moe_block(const MoEBlock *b, const void *x, const void *residual, int64_t T, void *y, int threads) {
    int64_t E = b->experts, k = b->topk, K = b->hidden, size = b->bf ? 2 : 4;
    float *logits = malloc(T * E * sizeof(float)), *weights = malloc(T * k * sizeof(float));
    int64_t *ids = malloc(T * k * sizeof(int64_t));
    char *moe = malloc(T * K * size);
    int bad = 0;
    ls_dense_linear(x, T, K, b->router, E, logits, b->bf, threads); /* fp32 weight and logits */
    ls_route(logits, T, E, k, b->sigmoid, b->groups, b->topk_groups, b->bias, b->norm, b->scaling, weights, ids);
    if (b->bits[0])
        quantized_tokens(b, x, T, weights, ids, moe, threads);
    else
        bad = ls_stacked_experts(x, T, K, b->inter, k, ids, weights, 0, E, b->w13, b->w2t, b->shared_chunks, b->sg,
                                 b->su, b->sd, moe, b->bf ? 0b111 : 0, threads);
    if (!bad)
        for (int64_t i = 0; i < T * K; i++) /* the residual, rounded as torch's add rounds it */
            store_out(y, b->bf, i, load_act(residual, b->bf, i) + load_act(moe, b->bf, i));
    free(logits), free(weights), free(ids), free(moe);
    return bad;
}
