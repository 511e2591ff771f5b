/* A decode step's whole MLA attention block in one call: y = x + o_proj(attention(input_norm(x))) for T decode
 * tokens, and post_norm(y) (the MLP's input), chaining the kernels the layer's modules call one by one (norms,
 * linears in fp32/bf16, int8 or int4, the latent prologue, the absorbed per-head products, paged decode attention)
 * with the same arguments in the same order, so the result equals theirs to the bit. It saves the ~50 torch ops
 * and Python calls between them, which cost more than the arithmetic at decode sizes. Activations and norms are
 * all fp32 or all bf16 (`bf`); the cache fp32, bf16, fp8 or int8 (`cache_io`: the io bits 1, 3 and 4 of kv_rows.h). */
#include "simd.h"

enum { DENSE = 0, INT8 = 1, INT4 = 2, INT8_LANES = 3 };

/* One projection's weight as its layer's kernel reads it. DENSE: w `[N, K]` in the block's dtype (per-head
 * products: bmm's `[H, K, N]`); INT8: w int8 `[N, K]` (heads: `[H, N, K]`), per-row scale (fp32) and sum (int32);
 * INT8_LANES: the same in ls_int8_heads_lanes' layout; INT4: w in `pack_int4`'s layout with its group size. */
typedef struct {
    int32_t kind;
    const void *w, *scale, *qsum;
    int64_t group;
} Weight;

/* One layer's attention: shapes (q_lora 0: q_b is q_proj), weights, norm weights and epsilons, the softmax scale,
 * the rope style (prologue.c's numbering). */
typedef struct {
    int64_t hidden, heads, nope, rope, latent, v_dim, q_lora;
    Weight q_a, q_b, kv_a, o_proj, uk, uv;
    const void *input_norm, *q_a_norm, *kv_a_norm, *post_norm;
    float eps, q_a_eps, kv_a_eps, post_eps, scale;
    int32_t style, bf;
} MLABlock;

LS_API void ls_int8_heads(const void *x, int64_t M, int64_t H, int64_t K, const int8_t *w, const float *scale,
                          const int32_t *wsum, int64_t N, void *y, int io, int threads);
LS_API void ls_int8_heads_lanes(const void *x, int64_t M, int64_t H, int64_t K, const int8_t *w, const float *scale,
                                const int32_t *wsum, int64_t N, void *y, int io, int threads);
LS_API void ls_int4_linear(const void *x, int64_t M, int64_t K, const uint8_t *w, int64_t G, int64_t N, void *y, int io,
                           int threads);

/* y[m, h] = x[m, h] @ W[h] over H heads (H = 1: a linear layer), in and out in the block's dtype. */
static void product(const Weight *w, const void *x, int64_t M, int64_t H, int64_t K, int64_t N, void *y, int bf,
                    int threads) {
    int io = bf ? 0b11 : 0;
    if (w->kind == INT8)
        ls_int8_heads(x, M, H, K, w->w, w->scale, w->qsum, N, y, io, threads);
    else if (w->kind == INT8_LANES)
        ls_int8_heads_lanes(x, M, H, K, w->w, w->scale, w->qsum, N, y, io, threads);
    else if (w->kind == INT4)
        ls_int4_linear(x, M, K, w->w, w->group, N, y, io, threads);
    else if (H == 1)
        ls_dense_linear(x, M, K, w->w, N, y, io | bf << 2, threads);
    else
        ls_dense_heads(x, M, H, K, w->w, N, y, io | bf << 2, threads);
}

/* Decode metadata of the step (the cache's block table, query starts and lengths per request, slots per token).
 * Returns decode_metadata_error's code, or 5 where a slot lies past the cache, computing nothing; else 0. */
LS_API int ls_mla_attention_block(const MLABlock *w, const void *x, int64_t T, const float *cos, const float *sin,
                                  void *cache, int cache_io, int64_t block_size, const int32_t *block_table,
                                  int64_t bt_stride, const int32_t *qsl, const int32_t *seq_lens, int64_t requests,
                                  const int64_t *slots, void *y, void *y_normed, int threads, int64_t blocks,
                                  int64_t bt_width) {
    int bad = decode_metadata_error(T, qsl, seq_lens, requests, block_table, bt_stride, bt_width, blocks, block_size);
    if (bad) return bad;
    if (bad_slot(slots, T, blocks * block_size) >= 0) return 5;
    int64_t size = w->bf ? 2 : 4, H = w->heads, D = w->nope + w->rope, L = w->latent;
    int bf = w->bf, norm_io = bf ? 0b101 : 0;
    char *xn = malloc(T * w->hidden * size), *q = malloc(T * H * D * size), *kv = malloc(T * (L + w->rope) * size);
    char *kv_c = malloc(T * L * size), *k_pe = malloc(T * w->rope * size), *qn = malloc(T * H * w->nope * size);
    char *ql = malloc(T * H * L * size), *qcat = malloc(T * H * (L + w->rope) * size), *ol = malloc(T * H * L * size);
    char *heads = malloc(T * H * w->v_dim * size), *attn = malloc(T * w->hidden * size);
    ls_rms_norm(x, T, w->hidden, w->input_norm, w->eps, xn, norm_io, threads);
    if (w->q_lora) {
        char *qa = malloc(T * w->q_lora * size), *qan = malloc(T * w->q_lora * size);
        product(&w->q_a, xn, T, 1, w->hidden, w->q_lora, qa, bf, threads);
        ls_rms_norm(qa, T, w->q_lora, w->q_a_norm, w->q_a_eps, qan, norm_io, threads);
        product(&w->q_b, qan, T, 1, w->q_lora, H * D, q, bf, threads);
        free(qa);
        free(qan);
    } else {
        product(&w->q_b, xn, T, 1, w->hidden, H * D, q, bf, threads);
    }
    product(&w->kv_a, xn, T, 1, w->hidden, L + w->rope, kv, bf, threads);
    ls_mla_prologue(q, T, H, D, kv, L, w->rope, w->kv_a_norm, w->kv_a_eps, cos, sin, w->style, kv_c, k_pe, cache,
                    slots, norm_io | cache_io, threads, blocks * block_size);
    for (int64_t r = 0; r < T * H; r++) /* q_nope, contiguous: the per-head products read it so */
        memcpy(qn + r * w->nope * size, q + r * D * size, w->nope * size);
    product(&w->uk, qn, T, H, w->nope, L, ql, bf, threads);
    for (int64_t r = 0; r < T * H; r++) { /* [q_latent ‖ q_pe] */
        memcpy(qcat + r * (L + w->rope) * size, ql + r * L * size, L * size);
        memcpy(qcat + (r * (L + w->rope) + L) * size, q + (r * D + w->nope) * size, w->rope * size);
    }
    ls_mla_decode(qcat, T, H, L + w->rope, L, cache, block_size, block_table, bt_stride, qsl, seq_lens, requests,
                  w->scale, ol, bf | cache_io | bf << 2, threads, blocks, bt_width);
    product(&w->uv, ol, T, H, L, w->v_dim, heads, bf, threads);
    product(&w->o_proj, heads, T, 1, H * w->v_dim, w->hidden, attn, bf, threads);
    for (int64_t i = 0; i < T * w->hidden; i++) /* the residual, rounded as torch's add rounds it */
        store_out(y, bf, i, load_act(x, bf, i) + load_act(attn, bf, i));
    ls_rms_norm(y, T, w->hidden, w->post_norm, w->post_eps, y_normed, norm_io, threads);
    free(xn), free(q), free(kv), free(kv_c), free(k_pe), free(qn), free(ql), free(qcat), free(ol), free(heads);
    free(attn);
    return 0;
}
