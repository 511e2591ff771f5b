/* A decode step's whole MLA attention block in one call: y = x + o_proj(attention(input_norm(x))) for T decode
 * tokens, and post_norm(y) (the MLP's input), chaining the kernels the layer's modules call one by one (norms, linears, the latent prologue, the
 * absorbed per-head products, paged decode attention) with the same arguments in the same order, so the result
 * equals theirs to the bit. It saves the ~50 torch ops and Python calls between them, which cost more than the
 * arithmetic at decode sizes. Weights and activations are all fp32 or all bf16 (`bf`); the cache either. */
#include "simd.h"

/* One layer's attention weights and shapes, filled in once by the caller. */
typedef struct {
    int64_t hidden, heads, nope, rope, latent, v_dim, q_lora; /* q_lora 0: one q_proj */
    const void *input_norm, *q_a, *q_a_norm, *q_b, *kv_a, *kv_a_norm, *w_uk_t, *w_uv, *o_proj, *post_norm;
    float eps, q_a_eps, kv_a_eps, scale, post_eps;
    int32_t style, bf; /* rope style (prologue.c's numbering); weights and activations bf16 */
} MLABlock;

/* Decode metadata of the step (the cache's block table, query starts and lengths per request, slots per token). */
void ls_mla_attention_block(const MLABlock *w, const void *x, int64_t T, const float *cos, const float *sin,
                            void *cache, int cbf, int64_t block_size, const int32_t *block_table, int64_t bt_stride,
                            const int32_t *qsl, const int32_t *seq_lens, int64_t requests, const int64_t *slots,
                            void *y, void *y_normed, int threads) {
    int64_t size = w->bf ? 2 : 4, H = w->heads, D = w->nope + w->rope, L = w->latent;
    int io = w->bf ? 0b111 : 0, norm_io = w->bf ? 0b101 : 0;
    char *xn = malloc(T * w->hidden * size), *q = malloc(T * H * D * size), *kv = malloc(T * (L + w->rope) * size);
    char *kv_c = malloc(T * L * size), *k_pe = malloc(T * w->rope * size), *qn = malloc(T * H * w->nope * size);
    char *ql = malloc(T * H * L * size), *qcat = malloc(T * H * (L + w->rope) * size), *ol = malloc(T * H * L * size);
    char *heads = malloc(T * H * w->v_dim * size), *attn = malloc(T * w->hidden * size);
    ls_rms_norm(x, T, w->hidden, w->input_norm, w->eps, xn, norm_io, threads);
    if (w->q_lora) {
        char *qa = malloc(T * w->q_lora * size), *qan = malloc(T * w->q_lora * size);
        ls_dense_linear(xn, T, w->hidden, w->q_a, w->q_lora, qa, io, threads);
        ls_rms_norm(qa, T, w->q_lora, w->q_a_norm, w->q_a_eps, qan, norm_io, threads);
        ls_dense_linear(qan, T, w->q_lora, w->q_b, H * D, q, io, threads);
        free(qa);
        free(qan);
    } else {
        ls_dense_linear(xn, T, w->hidden, w->q_b, H * D, q, io, threads);
    }
    ls_dense_linear(xn, T, w->hidden, w->kv_a, L + w->rope, kv, io, threads);
    ls_mla_prologue(q, T, H, D, kv, L, w->rope, w->kv_a_norm, w->kv_a_eps, cos, sin, w->style, kv_c, k_pe, cache,
                    slots, norm_io | cbf << 1, threads);
    for (int64_t r = 0; r < T * H; r++) /* q_nope, contiguous: the per-head products read it so */
        memcpy(qn + r * w->nope * size, q + r * D * size, w->nope * size);
    ls_dense_heads(qn, T, H, w->nope, w->w_uk_t, L, ql, io, threads);
    for (int64_t r = 0; r < T * H; r++) { /* [q_latent ‖ q_pe] */
        memcpy(qcat + r * (L + w->rope) * size, ql + r * L * size, L * size);
        memcpy(qcat + (r * (L + w->rope) + L) * size, q + (r * D + w->nope) * size, w->rope * size);
    }
    ls_mla_decode(qcat, T, H, L + w->rope, L, cache, block_size, block_table, bt_stride, qsl, seq_lens, requests,
                  w->scale, ol, w->bf | cbf << 1 | w->bf << 2, threads);
    ls_dense_heads(ol, T, H, L, w->w_uv, w->v_dim, heads, io, threads);
    ls_dense_linear(heads, T, H * w->v_dim, w->o_proj, w->hidden, attn, io, threads);
    for (int64_t i = 0; i < T * w->hidden; i++) /* the residual, rounded as torch's add rounds it */
        store_out(y, w->bf, i, load_act(x, w->bf, i) + load_act(attn, w->bf, i));
    ls_rms_norm(y, T, w->hidden, w->post_norm, w->post_eps, y_normed, norm_io, threads);
    free(xn), free(q), free(kv), free(kv_c), free(k_pe), free(qn), free(ql), free(qcat), free(ol), free(heads);
    free(attn);
}
