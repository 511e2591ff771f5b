/* A decode step's whole MLA attention block in one call: y = x + o_proj(attention(input_norm(x))) for T decode tokens,
 * and post_norm(y) (the MLP's input), chaining the kernels the layer's modules call one by one (norms, linears in
 * fp32/bf16, int8, int4, Q6_K, Q5_0, Q5_K or Q4_K, the latent prologue, the absorbed per-head products, paged decode
 * attention) with the same arguments in the same order, so the result equals theirs to the bit. It saves the ~50 torch
 * ops and Python calls between them, which cost more than the arithmetic at decode sizes. Activations and norms are all
 * fp32 or all bf16 (`bf`); the cache fp32, bf16, fp8 or int8 (`cache_io`: the io bits 1, 3 and 4 of kv_rows.h). The
 * intermediate activations come from the scratch arena. */
#include "quant.h"

/* y[m, h] = x[m, h] @ W[h] over H heads (H = 1: a linear layer), in and out in the block's dtype. */
static int product(const Weight *w, const void *x, int64_t M, int64_t H, int64_t K, int64_t N, void *y, int bf,
                   int threads) {
    int io = bf ? 0b11 : 0;
    Format f = weight_format(w->kind, w->group);
    if (f.bits) return quant_linear(x, M, K, w->w, f, N, y, io, threads);
    if (w->kind == LS_INT8) return int8_heads(x, M, H, K, w->w, w->scale, w->qsum, N, y, io, threads);
    if (w->kind == LS_INT8_LANES) return int8_heads_lanes(x, M, H, K, w->w, w->scale, w->qsum, N, y, io, threads);
    if (H == 1) return dense_linear(x, M, K, w->w, N, y, io | bf << 2, threads);
    return dense_heads(x, M, H, K, w->w, N, y, io | bf << 2, threads);
}

/* The block's temporaries: `size`-byte elements. */
typedef struct {
    char *xn, *q, *kv, *kv_c, *k_pe, *qn, *ql, *qcat, *ol, *heads, *attn, *qa, *qan;
} Buffers;

static int take(const MLABlock *w, int64_t T, int64_t size, Buffers *b) {
    int64_t H = w->heads, D = w->nope + w->rope, L = w->latent, R = w->rope;
    char **slot[] = {&b->xn, &b->q, &b->kv, &b->kv_c, &b->k_pe, &b->qn, &b->ql, &b->qcat, &b->ol, &b->heads,
                     &b->attn, &b->qa, &b->qan};
    int64_t widths[] = {w->hidden, H * D, L + R, L, R, H * w->nope, H * L, H * (L + R), H * L, H * w->v_dim,
                        w->hidden, w->q_lora, w->q_lora};
    for (size_t i = 0; i < sizeof widths / sizeof *widths; i++)
        if (!(*slot[i] = scratch(T * widths[i] * size))) return LS_NO_MEMORY;
    return LS_OK;
}

/* The metadata checked (bounds.c) by the entry point. */
int mla_attention_block(const MLABlock *w, const void *x, int64_t T, const float *cos, const float *sin, void *cache,
                        int cache_io, int64_t block_size, int64_t blocks, const int32_t *block_table,
                        int64_t bt_stride, const int32_t *qsl, const int32_t *seq_lens, int64_t requests,
                        const int64_t *slots, void *y, void *y_normed, int threads) {
    int64_t size = w->bf ? 2 : 4, H = w->heads, D = w->nope + w->rope, L = w->latent;
    int bf = w->bf, norm_io = bf ? 0b101 : 0;
    ScratchMark mark = scratch_mark();
    Buffers b;
    int bad = take(w, T, size, &b);
    if (bad) goto done;
    rms_norm(x, T, w->hidden, w->input_norm, w->eps, b.xn, norm_io, threads);
    if (w->q_lora) {
        if ((bad = product(&w->q_a, b.xn, T, 1, w->hidden, w->q_lora, b.qa, bf, threads))) goto done;
        rms_norm(b.qa, T, w->q_lora, w->q_a_norm, w->q_a_eps, b.qan, norm_io, threads);
        if ((bad = product(&w->q_b, b.qan, T, 1, w->q_lora, H * D, b.q, bf, threads))) goto done;
    } else if ((bad = product(&w->q_b, b.xn, T, 1, w->hidden, H * D, b.q, bf, threads))) {
        goto done;
    }
    if ((bad = product(&w->kv_a, b.xn, T, 1, w->hidden, L + w->rope, b.kv, bf, threads))) goto done;
    mla_prologue(b.q, T, H, D, b.kv, L, w->rope, w->kv_a_norm, w->kv_a_eps, cos, sin, w->style, b.kv_c, b.k_pe, cache,
                 slots, norm_io | cache_io, threads);
    for (int64_t r = 0; r < T * H; r++) /* q_nope, contiguous: the per-head products read it so */
        memcpy(b.qn + r * w->nope * size, b.q + r * D * size, w->nope * size);
    if ((bad = product(&w->uk, b.qn, T, H, w->nope, L, b.ql, bf, threads))) goto done;
    for (int64_t r = 0; r < T * H; r++) { /* [q_latent ‖ q_pe] */
        memcpy(b.qcat + r * (L + w->rope) * size, b.ql + r * L * size, L * size);
        memcpy(b.qcat + (r * (L + w->rope) + L) * size, b.q + (r * D + w->nope) * size, w->rope * size);
    }
    if ((bad = mla_decode(b.qcat, T, H, L + w->rope, L, cache, block_size, block_table, bt_stride, qsl, seq_lens,
                          requests, w->scale, b.ol, bf | cache_io | bf << 2, threads)))
        goto done;
    if ((bad = product(&w->uv, b.ol, T, H, L, w->v_dim, b.heads, bf, threads))) goto done;
    if ((bad = product(&w->o_proj, b.heads, T, 1, H * w->v_dim, w->hidden, b.attn, bf, threads))) goto done;
    for (int64_t i = 0; i < T * w->hidden; i++) /* the residual, rounded as torch's add rounds it */
        store_out(y, bf, i, load_act(x, bf, i) + load_act(b.attn, bf, i));
    rms_norm(y, T, w->hidden, w->post_norm, w->post_eps, y_normed, norm_io, threads);
done:
    scratch_release(mark);
    return bad;
}
