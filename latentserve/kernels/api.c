/* The entry points of latentserve.h: each checks its descriptors (rank, dtype, contiguity, sizes tied to each
 * other) and block structs, reads the sizes and dtypes from them, and calls the kernel. native.py checks the same
 * before it calls, with messages naming torch's terms; these checks keep a caller that skips native.py from reading
 * or writing out of bounds, and cost a few comparisons a call. */
#include <stddef.h>
#include <stdio.h>

#include "quant.h"

#define BIT(d) (1u << (d))
#define ACT (BIT(LS_F32) | BIT(LS_BF16))
#define CACHE (ACT | BIT(LS_F8_E4M3) | BIT(LS_I8))
#define DIM(t, d) ((t)->shape[d])

static const char *const DTYPE_NAMES[] = {"fp32", "bf16", "fp8_e4m3", "int8", "uint8", "int32", "int64"};

/* t non-NULL, of a dtype in `dtypes`, of rank `ndim` (-1: any), with non-negative sizes, laid out contiguously
 * (`rows`: only its last dimension need be, as a block table's); its data non-NULL unless it is empty. */
static int bad_tensor(const char *name, const ls_tensor *t, unsigned dtypes, int ndim, int rows) {
    if (!t) return refuse(LS_BAD_TENSOR, "%s: no descriptor", name);
    if (t->ndim < 0 || t->ndim > LS_MAX_DIMS || (ndim >= 0 && t->ndim != ndim))
        return refuse(LS_BAD_TENSOR, "%s: rank %d, not %d", name, t->ndim, ndim);
    if (t->dtype < LS_F32 || t->dtype > LS_I64 || !(dtypes & BIT(t->dtype)))
        return refuse(LS_BAD_TENSOR, "%s: dtype %d (%s) is not one this kernel reads", name, t->dtype,
                      t->dtype >= LS_F32 && t->dtype <= LS_I64 ? DTYPE_NAMES[t->dtype] : "unknown");
    int64_t stride = 1, numel = 1;
    for (int d = t->ndim - 1; d >= 0; d--) {
        if (t->shape[d] < 0) return refuse(LS_BAD_TENSOR, "%s: size %lld of dim %d", name, (long long)t->shape[d], d);
        int laid_out = rows && d < t->ndim - 1 ? t->strides[d] >= stride : t->strides[d] == stride;
        if (t->shape[d] > 1 && !laid_out)
            return refuse(LS_BAD_TENSOR, "%s: stride %lld of dim %d is not the contiguous %lld", name,
                          (long long)t->strides[d], d, (long long)stride);
        stride *= t->shape[d], numel *= t->shape[d];
    }
    if (!t->data && numel) return refuse(LS_BAD_TENSOR, "%s: NULL data", name);
    return LS_OK;
}

static int64_t numel(const ls_tensor *t) {
    int64_t n = 1;
    for (int d = 0; d < t->ndim; d++) n *= t->shape[d];
    return n;
}

/* `a`'s dim `d` is `size`, else LS_BAD_TENSOR naming both. */
static int bad_size(const char *name, const ls_tensor *t, int d, int64_t size) {
    if (DIM(t, d) == size) return LS_OK;
    return refuse(LS_BAD_TENSOR, "%s: dim %d is %lld, not %lld", name, d, (long long)DIM(t, d), (long long)size);
}

static int bf(const ls_tensor *t) { return t->dtype == LS_BF16; }
/* kv_rows.h's io bits of a cache. */
static int cache_io(const ls_tensor *cache) {
    return bf(cache) << 1 | (cache->dtype == LS_F8_E4M3) << 3 | (cache->dtype == LS_I8) << 4;
}
/* A cache row's elements for `values` values: an int8 row's scales follow them. */
static int64_t cache_width(const ls_tensor *cache, int64_t values) {
    return values + (cache->dtype == LS_I8) * LS_INT8_ROW_SCALES;
}

/* CHECK: return a check's own code; TENSORS: return LS_BAD_TENSOR where any of the checks `||`-ed fails. */
#define CHECK(expr)                                                                                                  \
    do {                                                                                                             \
        int bad_ = (expr);                                                                                           \
        if (bad_) return bad_;                                                                                       \
    } while (0)
#define TENSORS(expr)                                                                                                \
    do {                                                                                                             \
        if (expr) return LS_BAD_TENSOR;                                                                              \
    } while (0)

LS_API int ls_dense_linear(const ls_tensor *x, const ls_tensor *w, const ls_tensor *y, int threads) {
    TENSORS(bad_tensor("x", x, ACT, 2, 0) || bad_tensor("w", w, ACT, 2, 0) || bad_tensor("y", y, ACT, 2, 0));
    TENSORS(bad_size("w", w, 1, DIM(x, 1)) || bad_size("y", y, 0, DIM(x, 0)) || bad_size("y", y, 1, DIM(w, 0)));
    return dense_linear(x->data, DIM(x, 0), DIM(x, 1), w->data, DIM(w, 0), y->data, bf(x) | bf(y) << 1 | bf(w) << 2,
                        threads);
}

LS_API int ls_dense_heads(const ls_tensor *x, const ls_tensor *w, const ls_tensor *y, int threads) {
    TENSORS(bad_tensor("x", x, ACT, 3, 0) || bad_tensor("w", w, ACT, 3, 0) || bad_tensor("y", y, ACT, 3, 0));
    TENSORS(bad_size("w", w, 0, DIM(x, 1)) || bad_size("w", w, 1, DIM(x, 2)) || bad_size("y", y, 0, DIM(x, 0)));
    TENSORS(bad_size("y", y, 1, DIM(x, 1)) || bad_size("y", y, 2, DIM(w, 2)));
    if (DIM(w, 2) % 16) return refuse(LS_BAD_TENSOR, "w: N %lld is not a multiple of 16", (long long)DIM(w, 2));
    return dense_heads(x->data, DIM(x, 0), DIM(x, 1), DIM(x, 2), w->data, DIM(w, 2), y->data,
                       bf(x) | bf(y) << 1 | bf(w) << 2, threads);
}

/* x [M, K] with q [N, K] (one head) or x [M, H, K] with q [H, N, K] (`lanes`: [H, N / 16, K / 4, 16, 4]); y the
 * products, scale fp32 and qsum int32 of H * N each. */
static int int8_call(const ls_tensor *x, const ls_tensor *q, const ls_tensor *scale, const ls_tensor *qsum,
                     const ls_tensor *y, int threads, int lanes) {
    TENSORS(bad_tensor("x", x, ACT, -1, 0));
    if (x->ndim != 3 && (lanes || x->ndim != 2)) return refuse(LS_BAD_TENSOR, "x: rank %d", x->ndim);
    TENSORS(bad_tensor("y", y, ACT, x->ndim, 0));
    int heads = x->ndim == 3;
    int64_t M = DIM(x, 0), H = heads ? DIM(x, 1) : 1, K = DIM(x, x->ndim - 1), N;
    if (lanes) {
        TENSORS(bad_tensor("q", q, BIT(LS_I8), 5, 0) || bad_size("q", q, 0, H) || bad_size("q", q, 2, K / 4));
        TENSORS(bad_size("q", q, 3, 16) || bad_size("q", q, 4, 4));
        if (K % 4) return refuse(LS_BAD_TENSOR, "x: K %lld is not a multiple of 4", (long long)K);
        N = DIM(q, 1) * 16;
    } else {
        TENSORS(bad_tensor("q", q, BIT(LS_I8), x->ndim, 0) || (heads && bad_size("q", q, 0, H)));
        TENSORS(bad_size("q", q, heads + 1, K));
        N = DIM(q, heads);
    }
    TENSORS(bad_tensor("scale", scale, BIT(LS_F32), -1, 0) || bad_tensor("qsum", qsum, BIT(LS_I32), -1, 0));
    if (numel(scale) != H * N || numel(qsum) != H * N)
        return refuse(LS_BAD_TENSOR, "scale and qsum: %lld and %lld values, not %lld", (long long)numel(scale),
                      (long long)numel(qsum), (long long)(H * N));
    TENSORS(bad_size("y", y, 0, M) || (heads && bad_size("y", y, 1, H)) || bad_size("y", y, heads + 1, N));
    return (lanes ? int8_heads_lanes : int8_heads)(x->data, M, H, K, q->data, scale->data, qsum->data, N, y->data,
                                                   bf(x) | bf(y) << 1, threads);
}

LS_API int ls_int8_heads(const ls_tensor *x, const ls_tensor *q, const ls_tensor *scale, const ls_tensor *qsum,
                         const ls_tensor *y, int threads) {
    return int8_call(x, q, scale, qsum, y, threads, 0);
}

LS_API int ls_int8_heads_lanes(const ls_tensor *x, const ls_tensor *q, const ls_tensor *scale, const ls_tensor *qsum,
                               const ls_tensor *y, int threads) {
    return int8_call(x, q, scale, qsum, y, threads, 1);
}

LS_API int ls_int4_linear(const ls_tensor *x, const ls_tensor *packed, int64_t group, const ls_tensor *y,
                          int threads) {
    TENSORS(bad_tensor("x", x, ACT, 2, 0) || bad_tensor("packed", packed, BIT(LS_U8), 2, 0));
    TENSORS(bad_tensor("y", y, ACT, 2, 0) || bad_size("y", y, 0, DIM(x, 0)));
    int64_t K = DIM(x, 1), N = DIM(y, 1);
    if ((group != 32 && group != 64 && group != 128) || K % 64 || K % group)
        return refuse(LS_BAD_TENSOR, "group size %lld with K %lld", (long long)group, (long long)K);
    TENSORS(bad_size("packed", packed, 0, (N + 15) / 16) || bad_size("packed", packed, 1, K / group * (64 + 8 * group)));
    return quant_linear(x->data, DIM(x, 0), K, packed->data, (Format){4, group, 0}, N, y->data, bf(x) | bf(y) << 1,
                        threads);
}

/* A linear layer over one of llama.cpp's formats kept as its blocks (Format (bits, group)): K a multiple of `multiple`
 * (the kernel's), the weight as many blocks of 16 outputs as y has, each block_bytes long. */
static int blocks_linear(const char *name, int64_t multiple, Format f, const ls_tensor *x, const ls_tensor *packed,
                         const ls_tensor *y, int threads) {
    TENSORS(bad_tensor("x", x, ACT, 2, 0) || bad_tensor("packed", packed, BIT(LS_U8), 2, 0));
    TENSORS(bad_tensor("y", y, ACT, 2, 0) || bad_size("y", y, 0, DIM(x, 0)));
    int64_t K = DIM(x, 1), N = DIM(y, 1);
    if (K % multiple)
        return refuse(LS_BAD_TENSOR, "x: K %lld is not a multiple of %lld (the %s kernel's)", (long long)K,
                      (long long)multiple, name);
    TENSORS(bad_size("packed", packed, 0, (N + 15) / 16) || bad_size("packed", packed, 1, block_bytes(f, K)));
    return quant_linear(x->data, DIM(x, 0), K, packed->data, f, N, y->data, bf(x) | bf(y) << 1, threads);
}

LS_API int ls_q6k_linear(const ls_tensor *x, const ls_tensor *packed, const ls_tensor *y, int threads) {
    return blocks_linear("Q6_K", 256, (Format){6, 16, 0}, x, packed, y, threads);
}

LS_API int ls_q2k_linear(const ls_tensor *x, const ls_tensor *packed, const ls_tensor *y, int threads) {
    return blocks_linear("Q2_K", 256, (Format){2, 16, 0}, x, packed, y, threads);
}

LS_API int ls_q3k_linear(const ls_tensor *x, const ls_tensor *packed, const ls_tensor *y, int threads) {
    return blocks_linear("Q3_K", 256, (Format){3, 16, 0}, x, packed, y, threads);
}

LS_API int ls_q50_linear(const ls_tensor *x, const ls_tensor *packed, const ls_tensor *y, int threads) {
    return blocks_linear("Q5_0", 64, (Format){5, 32, 0}, x, packed, y, threads);
}

LS_API int ls_q51_linear(const ls_tensor *x, const ls_tensor *packed, const ls_tensor *y, int threads) {
    return blocks_linear("Q5_1", 64, (Format){5, 32, 1}, x, packed, y, threads);
}

LS_API int ls_q5k_linear(const ls_tensor *x, const ls_tensor *packed, const ls_tensor *y, int threads) {
    return blocks_linear("Q5_K", 256, (Format){5, 256, 0}, x, packed, y, threads);
}

LS_API int ls_q4k_linear(const ls_tensor *x, const ls_tensor *packed, const ls_tensor *y, int threads) {
    return blocks_linear("Q4_K", 256, (Format){4, 256, 0}, x, packed, y, threads);
}

LS_API int ls_int8_linear(const ls_tensor *x, const ls_tensor *packed, const ls_tensor *y, int threads) {
    TENSORS(bad_tensor("x", x, ACT, 2, 0) || bad_tensor("packed", packed, BIT(LS_I8), 2, 0));
    TENSORS(bad_tensor("y", y, ACT, 2, 0) || bad_size("y", y, 0, DIM(x, 0)));
    int64_t K = DIM(x, 1), N = DIM(y, 1);
    if (K % 4) return refuse(LS_BAD_TENSOR, "x: K %lld is not a multiple of 4", (long long)K);
    TENSORS(bad_size("packed", packed, 0, (N + 15) / 16) || bad_size("packed", packed, 1, 128 + 16 * K));
    return quant_linear(x->data, DIM(x, 0), K, packed->data, (Format){8, 0, 0}, N, y->data, bf(x) | bf(y) << 1,
                        threads);
}

LS_API int ls_rms_norm(const ls_tensor *x, const ls_tensor *w, float eps, const ls_tensor *y, int threads) {
    TENSORS(bad_tensor("x", x, ACT, 2, 0) || bad_tensor("w", w, ACT, 1, 0) || bad_size("w", w, 0, DIM(x, 1)));
    TENSORS(bad_tensor("y", y, BIT(x->dtype), 2, 0) || bad_size("y", y, 0, DIM(x, 0)) || bad_size("y", y, 1, DIM(x, 1)));
    rms_norm(x->data, DIM(x, 0), DIM(x, 1), w->data, eps, y->data, bf(x) | bf(w) << 2, threads);
    return LS_OK;
}

LS_API int ls_argmax(const ls_tensor *x, const ls_tensor *out, int threads) {
    TENSORS(bad_tensor("x", x, BIT(LS_F32), 2, 0) || bad_tensor("out", out, BIT(LS_I64), 1, 0));
    TENSORS(bad_size("out", out, 0, DIM(x, 0)));
    if (DIM(x, 1) < 1) return refuse(LS_BAD_TENSOR, "x: rows of %lld values", (long long)DIM(x, 1));
    argmax_rows(x->data, DIM(x, 0), DIM(x, 1), out->data, threads);
    return LS_OK;
}

/* cos and sin fp32 [T, R], R even, 0 < R <= LS_MAX_ROPE. */
static int bad_rotary(const ls_tensor *cos, const ls_tensor *sin, int64_t T, int64_t R) {
    TENSORS(bad_tensor("cos", cos, BIT(LS_F32), 2, 0) || bad_tensor("sin", sin, BIT(LS_F32), 2, 0));
    TENSORS(bad_size("cos", cos, 0, T) || bad_size("cos", cos, 1, R) || bad_size("sin", sin, 0, T));
    TENSORS(bad_size("sin", sin, 1, R));
    if (R % 2 || R <= 0 || R > LS_MAX_ROPE) return refuse(LS_BAD_TENSOR, "%lld rope dims", (long long)R);
    return LS_OK;
}

/* The cache [blocks, block_size, width] and int64 slots [T], each slot within the cache (LS_SLOT_PAST_CACHE). */
static int bad_slots(const ls_tensor *cache, const ls_tensor *slots, int64_t T, int64_t width) {
    TENSORS(bad_tensor("kv_cache", cache, CACHE, 3, 0) || bad_size("kv_cache", cache, 2, cache_width(cache, width)));
    TENSORS(bad_tensor("slot_mapping", slots, BIT(LS_I64), 1, 0) || bad_size("slot_mapping", slots, 0, T));
    return bad_slot(slots->data, T, DIM(cache, 0) * DIM(cache, 1)) >= 0 ? LS_SLOT_PAST_CACHE : LS_OK;
}

LS_API int ls_mla_prologue(const ls_tensor *q, const ls_tensor *kv, const ls_tensor *w, float eps,
                           const ls_tensor *cos, const ls_tensor *sin, int style, const ls_tensor *kv_c,
                           const ls_tensor *k_pe, const ls_tensor *kv_cache, const ls_tensor *slots, int threads) {
    TENSORS(bad_tensor("kv", kv, ACT, 2, 0) || bad_tensor("q", q, BIT(kv->dtype), 3, 0));
    int64_t T = DIM(kv, 0), width = DIM(kv, 1), R = cos ? DIM(cos, 1) : 0, L = width - R, D = DIM(q, 2);
    TENSORS(bad_size("q", q, 0, T) || bad_rotary(cos, sin, T, R));
    if (R >= width || R > D) return refuse(LS_BAD_TENSOR, "%lld rope dims with kv rows of %lld and q heads of %lld",
                                          (long long)R, (long long)width, (long long)D);
    if (width > LS_MAX_LATENT) /* a cache row decode attention could not read, staged on the stack (prologue.c) */
        return refuse(LS_BAD_TENSOR, "kv: rows of %lld (latent + rope), over the %d decode attention takes",
                      (long long)width, LS_MAX_LATENT);
    if (style < LS_ROPE_GPTJ || style > LS_ROPE_NEOX) return refuse(LS_BAD_TENSOR, "rope style %d", style);
    TENSORS(bad_tensor("w", w, ACT, 1, 0) || bad_size("w", w, 0, L));
    TENSORS(bad_tensor("kv_c", kv_c, BIT(kv->dtype), 2, 0) || bad_size("kv_c", kv_c, 0, T) || bad_size("kv_c", kv_c, 1, L));
    TENSORS(bad_tensor("k_pe", k_pe, BIT(kv->dtype), 2, 0) || bad_size("k_pe", k_pe, 0, T) || bad_size("k_pe", k_pe, 1, R));
    CHECK(bad_slots(kv_cache, slots, T, width));
    mla_prologue(q->data, T, DIM(q, 1), D, kv->data, L, R, w->data, eps, cos->data, sin->data, style, kv_c->data,
                 k_pe->data, kv_cache->data, slots->data, bf(kv) | bf(w) << 2 | cache_io(kv_cache), threads);
    return LS_OK;
}

/* The decode tables: int32 seq_lens [R], query_start_loc [R + 1], block_table [>= R, width] (unit column stride),
 * their values within the cache and the T query tokens (bounds.c). */
static int bad_tables(const ls_tensor *cache, const ls_tensor *table, const ls_tensor *qsl, const ls_tensor *lens,
                      int64_t T) {
    TENSORS(bad_tensor("seq_lens", lens, BIT(LS_I32), 1, 0) || bad_tensor("query_start_loc", qsl, BIT(LS_I32), 1, 0));
    int64_t R = DIM(lens, 0);
    TENSORS(bad_size("query_start_loc", qsl, 0, R + 1) || bad_tensor("block_table", table, BIT(LS_I32), 2, 1));
    if (DIM(table, 0) < R || DIM(cache, 1) < 1)
        return refuse(LS_BAD_TENSOR, "block_table: %lld rows for %lld requests", (long long)DIM(table, 0),
                      (long long)R);
    return decode_metadata_error(T, qsl->data, lens->data, R, table->data, table->strides[0], DIM(table, 1),
                                 DIM(cache, 0), DIM(cache, 1));
}

LS_API int ls_mla_decode(const ls_tensor *q, const ls_tensor *kv_cache, const ls_tensor *block_table,
                         const ls_tensor *query_start_loc, const ls_tensor *seq_lens, float scale,
                         const ls_tensor *out, int threads) {
    TENSORS(bad_tensor("q", q, ACT, 3, 0) || bad_tensor("kv_cache", kv_cache, CACHE, 3, 0));
    int64_t T = DIM(q, 0), H = DIM(q, 1), D = DIM(q, 2);
    if (D > LS_MAX_LATENT)
        return refuse(LS_BAD_TENSOR, "q: rows of %lld (latent + rope), over the %d decode attention takes",
                      (long long)D, LS_MAX_LATENT);
    TENSORS(bad_size("kv_cache", kv_cache, 2, cache_width(kv_cache, D)) || bad_tensor("out", out, ACT, 3, 0));
    TENSORS(bad_size("out", out, 0, T));
    TENSORS(bad_size("out", out, 1, H));
    int64_t L = DIM(out, 2);
    if (L <= 0 || L > D) return refuse(LS_BAD_TENSOR, "out: latent %lld not in 1..%lld", (long long)L, (long long)D);
    CHECK(bad_tables(kv_cache, block_table, query_start_loc, seq_lens, T));
    return mla_decode(q->data, T, H, D, L, kv_cache->data, DIM(kv_cache, 1), block_table->data,
                      block_table->strides[0], query_start_loc->data, seq_lens->data, DIM(seq_lens, 0), scale,
                      out->data, bf(q) | bf(out) << 2 | cache_io(kv_cache), threads);
}

/* q, k, v of one activation dtype as prefill_attention reads them: rank 3, unit column stride, each row and head at
 * least a row apart (bad_tensor's `rows`), k's heads and columns q's, v's tokens and heads k's. */
static int bad_attention_inputs(const ls_tensor *q, const ls_tensor *k, const ls_tensor *v) {
    TENSORS(bad_tensor("q", q, ACT, 3, 1) || bad_tensor("k", k, BIT(q->dtype), 3, 1) ||
            bad_tensor("v", v, BIT(q->dtype), 3, 1));
    TENSORS(bad_size("k", k, 1, DIM(q, 1)) || bad_size("k", k, 2, DIM(q, 2)) || bad_size("v", v, 0, DIM(k, 0)));
    TENSORS(bad_size("v", v, 1, DIM(q, 1)));
    return LS_OK;
}

LS_API int ls_prefill_attention(const ls_tensor *q, const ls_tensor *k, const ls_tensor *v, int causal,
                                int64_t distance, int64_t window, float scale, const ls_tensor *out,
                                const ls_tensor *lse, int threads) {
    CHECK(bad_attention_inputs(q, k, v));
    int64_t n = DIM(q, 0), H = DIM(q, 1);
    TENSORS(bad_tensor("out", out, ACT, 3, 0) || bad_size("out", out, 0, n) || bad_size("out", out, 1, H));
    TENSORS(bad_size("out", out, 2, DIM(v, 2)) || bad_tensor("lse", lse, BIT(LS_F32), 2, 0));
    TENSORS(bad_size("lse", lse, 0, n) || bad_size("lse", lse, 1, H));
    if (window < 0 || window > LS_MAX_POSITIONS)
        return refuse(LS_BAD_TENSOR, "window %lld is not in 0 (none) .. %lld", (long long)window, LS_MAX_POSITIONS);
    if (distance < -LS_MAX_POSITIONS || distance > LS_MAX_POSITIONS) /* positions are added: no overflow */
        return refuse(LS_BAD_TENSOR, "distance %lld is beyond +-%lld positions", (long long)distance,
                      LS_MAX_POSITIONS);
    int64_t qs[2] = {q->strides[0], q->strides[1]}, ks[2] = {k->strides[0], k->strides[1]};
    int64_t vs[2] = {v->strides[0], v->strides[1]};
    return prefill_attention(q->data, qs, k->data, ks, v->data, vs, n, DIM(k, 0), H, DIM(q, 2), DIM(v, 2), causal != 0,
                             distance, window, scale, out->data, lse->data, bf(q) | bf(out) << 1, threads);
}

/* k of E experts can be chosen from the best topk_groups of `groups`; sigmoid scores a group by its best two experts,
 * so a limit on groups of one expert would score every group -inf (torch's topk(2) refuses it too). */
static int bad_routing(int64_t E, int64_t k, int sigmoid, int64_t groups, int64_t topk_groups) {
    if (groups > 0 && 0 < topk_groups && topk_groups <= groups && E % groups == 0 && 0 < k &&
        k <= topk_groups * (E / groups) && !(sigmoid && topk_groups < groups && E / groups < 2))
        return LS_OK;
    return refuse(LS_BAD_TENSOR, "%lld of %lld experts from the best %lld of %lld groups%s", (long long)k, (long long)E,
                  (long long)topk_groups, (long long)groups, sigmoid ? " (sigmoid: at least 2 experts a group)" : "");
}

LS_API int ls_route(const ls_tensor *logits, int sigmoid, int64_t groups, int64_t topk_groups, const ls_tensor *bias,
                    int norm, float scaling, const ls_tensor *weights, const ls_tensor *ids) {
    TENSORS(bad_tensor("logits", logits, BIT(LS_F32), 2, 0) || bad_tensor("weights", weights, BIT(LS_F32), 2, 0));
    int64_t T = DIM(logits, 0), E = DIM(logits, 1), k = DIM(weights, 1);
    TENSORS(bad_size("weights", weights, 0, T) || bad_tensor("ids", ids, BIT(LS_I64), 2, 0));
    TENSORS(bad_size("ids", ids, 0, T) || bad_size("ids", ids, 1, k));
    TENSORS(bad_routing(E, k, sigmoid, groups, topk_groups));
    TENSORS(bias && (bad_tensor("bias", bias, BIT(LS_F32), 1, 0) || bad_size("bias", bias, 0, E)));
    return route(logits->data, T, E, k, sigmoid, groups, topk_groups, bias ? bias->data : NULL, norm, scaling,
                  weights->data, ids->data);
}

/* A format's weights over `in` inputs: bits 32, 16, 8 (in a multiple of 4), 4 (int4: group 32, 64 or 128 dividing in,
 * in a multiple of 64; Q4_K: group 256, in a multiple of 256), 6, 3 or 2 (Q6_K, Q3_K, Q2_K: group 16, in a multiple of
 * 256) or 5 (Q5_0, and Q5_1 with mins: group 32, in a multiple of 64; Q5_K: group 256, in a multiple of 256); mins 0
 * but for Q5_1. */
static int bad_format(int code, const char *name, Format f, int64_t in) {
    int32_t bits = f.bits;
    int64_t group = f.group;
    int groups32 = bits == 5 && group == 32; /* Q5_0's, Q5_1's */
    if ((f.mins == 0 || (f.mins == 1 && groups32)) &&
        (bits == 32 || bits == 16 || (bits == 8 && in % 4 == 0) ||
         (bits == 4 && (group == 32 || group == 64 || group == 128) && in % group == 0 && in % 64 == 0) ||
         ((bits == 6 || bits == 3 || bits == 2) && group == 16 && in % 256 == 0) || (groups32 && in % 64 == 0) ||
         ((bits == 5 || bits == 4) && group == 256 && in % 256 == 0)))
        return LS_OK;
    return refuse(code, "%s: bits %d, group %lld, mins %d over %lld inputs (32, 16, 8 with inputs a multiple of 4, 4 "
                  "with group 32, 64 or 128 dividing them and inputs a multiple of 64 or group 256 and inputs a "
                  "multiple of 256, 6, 3 or 2 with group 16 and inputs a multiple of 256, or 5 with group 32 and "
                  "inputs a multiple of 64 or group 256 and inputs a multiple of 256; mins 1 only with 5 and group "
                  "32)", name, bits, (long long)group, f.mins, (long long)in);
}

/* A projection's weight has what its kind reads, over `in` inputs (a blocked kind's: a multiple its format takes). */
static int bad_weight(const char *name, const Weight *w, int64_t in) {
    if (w->kind < LS_DENSE || w->kind > LS_Q3K) return refuse(LS_BAD_BLOCK, "%s.kind is %d", name, w->kind);
    if (!w->w) return refuse(LS_BAD_BLOCK, "%s.w is NULL", name);
    if ((w->kind == LS_INT8 || w->kind == LS_INT8_LANES) && (!w->scale || !w->qsum))
        return refuse(LS_BAD_BLOCK, "%s: an int8 weight without its scale or qsum", name);
    if (w->kind == LS_INT4 && w->group != 32 && w->group != 64 && w->group != 128)
        return refuse(LS_BAD_BLOCK, "%s.group is %lld, not 32, 64 or 128", name, (long long)w->group);
    if ((w->kind == LS_Q6K || w->kind == LS_Q3K || w->kind == LS_Q2K) && w->group != 16)
        return refuse(LS_BAD_BLOCK, "%s.group is %lld, not the 16 of Q6_K, Q3_K and Q2_K", name, (long long)w->group);
    if ((w->kind == LS_Q50 || w->kind == LS_Q51) && w->group != 32)
        return refuse(LS_BAD_BLOCK, "%s.group is %lld, not Q5_0's and Q5_1's 32", name, (long long)w->group);
    if ((w->kind == LS_Q5K || w->kind == LS_Q4K) && w->group != 256)
        return refuse(LS_BAD_BLOCK, "%s.group is %lld, not the k-quants' 256", name, (long long)w->group);
    Format f = weight_format(w->kind, w->group);
    return f.bits ? bad_format(LS_BAD_BLOCK, name, f, in) : LS_OK;
}

static int bad_mla_block(const MLABlock *b) {
    if (!b) return refuse(LS_BAD_BLOCK, "no MLABlock");
    if (b->hidden <= 0 || b->heads <= 0 || b->nope <= 0 || b->latent <= 0 || b->v_dim <= 0 || b->q_lora < 0)
        return refuse(LS_BAD_BLOCK, "sizes hidden %lld, heads %lld, nope %lld, latent %lld, v_dim %lld, q_lora %lld",
                      (long long)b->hidden, (long long)b->heads, (long long)b->nope, (long long)b->latent,
                      (long long)b->v_dim, (long long)b->q_lora);
    if (b->latent + b->rope > LS_MAX_LATENT)
        return refuse(LS_BAD_BLOCK, "latent %lld + rope %lld, over the %d decode attention takes", (long long)b->latent,
                      (long long)b->rope, LS_MAX_LATENT);
    if (b->style < LS_ROPE_GPTJ || b->style > LS_ROPE_NEOX) return refuse(LS_BAD_BLOCK, "style is %d", b->style);
    if (b->bf != 0 && b->bf != 1) return refuse(LS_BAD_BLOCK, "bf is %d, not 0 or 1", b->bf);
    if (!b->input_norm || !b->kv_a_norm || !b->post_norm || (b->q_lora && !b->q_a_norm))
        return refuse(LS_BAD_BLOCK, "a norm weight (input_norm, kv_a_norm, post_norm or q_a_norm) is NULL");
    if ((b->q_lora && bad_weight("q_a", &b->q_a, b->hidden)) ||
        bad_weight("q_b", &b->q_b, b->q_lora ? b->q_lora : b->hidden) || bad_weight("kv_a", &b->kv_a, b->hidden) ||
        bad_weight("o_proj", &b->o_proj, b->heads * b->v_dim) || bad_weight("uk", &b->uk, b->nope) ||
        bad_weight("uv", &b->uv, b->latent))
        return LS_BAD_BLOCK;
    /* The per-head products: dense ones through dense_heads (N a multiple of 16), int4 and int8 blocks only for
     * H = 1. */
    if ((b->uk.kind == LS_DENSE && b->latent % 16) || (b->uv.kind == LS_DENSE && b->v_dim % 16) ||
        (b->uk.kind != LS_DENSE && b->uk.kind != LS_INT8 && b->uk.kind != LS_INT8_LANES) ||
        (b->uv.kind != LS_DENSE && b->uv.kind != LS_INT8 && b->uv.kind != LS_INT8_LANES))
        return refuse(LS_BAD_BLOCK, "uk and uv: dense with latent and v_dim multiples of 16, or int8");
    return LS_OK;
}

LS_API int ls_mla_attention_block(const MLABlock *block, const ls_tensor *x, const ls_tensor *cos,
                                  const ls_tensor *sin, const ls_tensor *kv_cache, const ls_tensor *block_table,
                                  const ls_tensor *query_start_loc, const ls_tensor *seq_lens,
                                  const ls_tensor *slots, const ls_tensor *y, const ls_tensor *y_normed, int threads) {
    CHECK(bad_mla_block(block));
    unsigned dtype = BIT(block->bf ? LS_BF16 : LS_F32);
    TENSORS(bad_tensor("x", x, dtype, 2, 0) || bad_size("x", x, 1, block->hidden));
    int64_t T = DIM(x, 0);
    TENSORS(bad_tensor("y", y, dtype, 2, 0) || bad_size("y", y, 0, T) || bad_size("y", y, 1, block->hidden));
    TENSORS(bad_tensor("y_normed", y_normed, dtype, 2, 0) || bad_size("y_normed", y_normed, 0, T));
    TENSORS(bad_size("y_normed", y_normed, 1, block->hidden) || bad_rotary(cos, sin, T, block->rope));
    CHECK(bad_slots(kv_cache, slots, T, block->latent + block->rope));
    CHECK(bad_tables(kv_cache, block_table, query_start_loc, seq_lens, T));
    return mla_attention_block(block, x->data, T, cos->data, sin->data, kv_cache->data, cache_io(kv_cache),
                               DIM(kv_cache, 1), DIM(kv_cache, 0), block_table->data, block_table->strides[0],
                               query_start_loc->data, seq_lens->data, DIM(seq_lens, 0), slots->data, y->data,
                               y_normed->data, threads);
}

/* An ExpertTable of `experts` experts (-1: 0 or 1) of hidden size K, every weight pointer set; `code` on failure. */
static int bad_table(int code, const char *name, const ExpertTable *t, int64_t experts, int64_t K) {
    if (!t) return refuse(code, "%s: no ExpertTable", name);
    if (experts >= 0 ? t->experts != experts : t->experts != 0 && t->experts != 1)
        return refuse(code, "%s: %lld experts, not %s%lld", name, (long long)t->experts, experts < 0 ? "0 or " : "",
                      (long long)(experts < 0 ? 1 : experts));
    if (!t->experts) return LS_OK;
    if (t->inter <= 0) return refuse(code, "%s: inter %lld", name, (long long)t->inter);
    char what[64];
    snprintf(what, sizeof what, "%s gate_up", name);
    CHECK(bad_format(code, what, (Format){t->bits[0], t->group[0], t->mins[0]}, K));
    snprintf(what, sizeof what, "%s down", name);
    CHECK(bad_format(code, what, (Format){t->bits[1], t->group[1], t->mins[1]}, t->inter));
    if (!t->weights) return refuse(code, "%s: weights is NULL", name);
    for (int64_t i = 0; i < 2 * t->experts; i++)
        if (!t->weights[i]) return refuse(code, "%s: weights[%lld] is NULL", name, (long long)i);
    return LS_OK;
}

LS_API int ls_experts(const ExpertTable *routed, const ExpertTable *shared, const ls_tensor *x, const ls_tensor *ids,
                      const ls_tensor *weights, const ls_tensor *y, int threads) {
    TENSORS(bad_tensor("x", x, ACT, 2, 0) || bad_tensor("ids", ids, BIT(LS_I64), 2, 0));
    int64_t T = DIM(x, 0), K = DIM(x, 1), k = DIM(ids, 1);
    TENSORS(bad_size("ids", ids, 0, T) || bad_tensor("weights", weights, BIT(LS_F32), 2, 0));
    TENSORS(bad_size("weights", weights, 0, T) || bad_size("weights", weights, 1, k));
    TENSORS(bad_tensor("y", y, ACT, 2, 0) || bad_size("y", y, 0, T) || bad_size("y", y, 1, K));
    if (!routed) return refuse(LS_BAD_TENSOR, "routed: no ExpertTable");
    CHECK(bad_table(LS_BAD_TENSOR, "routed", routed, routed->experts > 0 ? routed->experts : 1, K));
    CHECK(shared ? bad_table(LS_BAD_TENSOR, "shared", shared, -1, K) : LS_OK);
    return experts(routed, shared, x->data, T, K, k, ids->data, weights->data, y->data, bf(x) | bf(y) << 1, threads);
}

static int bad_moe_block(const MoEBlock *b) {
    if (!b) return refuse(LS_BAD_BLOCK, "no MoEBlock");
    if (b->hidden <= 0) return refuse(LS_BAD_BLOCK, "hidden %lld", (long long)b->hidden);
    if (b->bf != 0 && b->bf != 1) return refuse(LS_BAD_BLOCK, "bf is %d, not 0 or 1", b->bf);
    if (!b->experts) { /* a dense MLP: nothing routes, so nothing of the routing may be set */
        if (b->topk || b->groups || b->topk_groups || b->sigmoid || b->norm || b->scaling != 1.f || b->router ||
            b->bias || b->routed.experts)
            return refuse(LS_BAD_BLOCK, "no routed experts: topk, groups, topk_groups, sigmoid, norm, router, bias "
                          "and routed must be 0 or NULL, scaling 1");
        return bad_table(LS_BAD_BLOCK, "shared", &b->shared, 1, b->hidden);
    }
    if (bad_routing(b->experts, b->topk, b->sigmoid, b->groups, b->topk_groups)) return LS_BAD_BLOCK;
    if (!b->router) return refuse(LS_BAD_BLOCK, "router is NULL");
    CHECK(bad_table(LS_BAD_BLOCK, "routed", &b->routed, b->experts, b->hidden));
    return bad_table(LS_BAD_BLOCK, "shared", &b->shared, -1, b->hidden);
}

LS_API int ls_moe_block(const MoEBlock *block, const ls_tensor *x, const ls_tensor *residual, const ls_tensor *y,
                        int threads) {
    CHECK(bad_moe_block(block));
    unsigned dtype = BIT(block->bf ? LS_BF16 : LS_F32);
    TENSORS(bad_tensor("x", x, dtype, 2, 0) || bad_size("x", x, 1, block->hidden));
    int64_t T = DIM(x, 0);
    TENSORS(bad_tensor("residual", residual, dtype, 2, 0) || bad_size("residual", residual, 0, T));
    TENSORS(bad_size("residual", residual, 1, block->hidden) || bad_tensor("y", y, dtype, 2, 0));
    TENSORS(bad_size("y", y, 0, T) || bad_size("y", y, 1, block->hidden));
    return moe_block(block, x->data, residual->data, T, y->data, threads);
}

/* Layers one ls_decode_layers call takes at most: their cache pointers sit on the stack (real models: up to ~100). */
#define MAX_LAYERS 4096

LS_API int ls_decode_layers(const MLABlock *const *attention, const MoEBlock *const *moe, const ls_tensor *kv_caches,
                            int64_t layers, const ls_tensor *x, const ls_tensor *cos, const ls_tensor *sin,
                            const ls_tensor *block_table, const ls_tensor *query_start_loc, const ls_tensor *seq_lens,
                            const ls_tensor *slots, const ls_tensor *norm, float eps, const ls_tensor *y,
                            int threads) {
    if (layers < 1 || layers > MAX_LAYERS || !attention || !moe || !kv_caches)
        return refuse(LS_BAD_BLOCK, "%lld layers (1 to %d), with their blocks and caches", (long long)layers,
                      MAX_LAYERS);
    void *caches[layers];
    for (int64_t l = 0; l < layers; l++) {
        const MLABlock *a = attention[l];
        CHECK(bad_mla_block(a));
        CHECK(bad_moe_block(moe[l]));
        if (a->bf != attention[0]->bf || moe[l]->bf != a->bf || a->hidden != attention[0]->hidden ||
            moe[l]->hidden != a->hidden || a->rope != attention[0]->rope)
            return refuse(LS_BAD_BLOCK, "layer %lld: its blocks' dtype, hidden size or rope dims differ from layer "
                          "0's attention", (long long)l);
        const ls_tensor *c = kv_caches + l;
        TENSORS(bad_tensor("kv_cache", c, CACHE, 3, 0));
        if (c->dtype != kv_caches->dtype || DIM(c, 0) != DIM(kv_caches, 0) || DIM(c, 1) != DIM(kv_caches, 1))
            return refuse(LS_BAD_TENSOR, "kv_caches[%lld]: its dtype or blocks differ from kv_caches[0]'s",
                          (long long)l);
        caches[l] = c->data;
    }
    const MLABlock *first = attention[0];
    unsigned dtype = BIT(first->bf ? LS_BF16 : LS_F32);
    TENSORS(bad_tensor("x", x, dtype, 2, 0) || bad_size("x", x, 1, first->hidden));
    int64_t T = DIM(x, 0);
    TENSORS(bad_tensor("y", y, dtype, 2, 0) || bad_size("y", y, 0, T) || bad_size("y", y, 1, first->hidden));
    TENSORS(bad_rotary(cos, sin, T, first->rope));
    if (norm) TENSORS(bad_tensor("norm", norm, dtype, 1, 0) || bad_size("norm", norm, 0, first->hidden));
    for (int64_t l = 0; l < layers; l++) {
        CHECK(bad_slots(kv_caches + l, slots, T, attention[l]->latent + attention[l]->rope));
        CHECK(bad_tables(kv_caches + l, block_table, query_start_loc, seq_lens, T));
    }
    return decode_layers(attention, moe, caches, layers, cache_io(kv_caches), DIM(kv_caches, 1), DIM(kv_caches, 0),
                         x->data, T, cos->data, sin->data, block_table->data, block_table->strides[0],
                         query_start_loc->data, seq_lens->data, DIM(seq_lens, 0), slots->data,
                         norm ? norm->data : NULL, eps, y->data, threads);
}

#define STRUCT(s) {#s, 0, sizeof(s)}
#define FIELD(s, f) {#s "." #f, offsetof(s, f), sizeof(((s *)0)->f)}
#define WEIGHT(f) FIELD(MLABlock, f)

static const ls_field LAYOUT[] = {
    STRUCT(ls_tensor), FIELD(ls_tensor, data), FIELD(ls_tensor, dtype), FIELD(ls_tensor, ndim),
    FIELD(ls_tensor, shape), FIELD(ls_tensor, strides),
    STRUCT(Weight), FIELD(Weight, kind), FIELD(Weight, w), FIELD(Weight, scale), FIELD(Weight, qsum),
    FIELD(Weight, group),
    STRUCT(MLABlock), FIELD(MLABlock, hidden), FIELD(MLABlock, heads), FIELD(MLABlock, nope), FIELD(MLABlock, rope),
    FIELD(MLABlock, latent), FIELD(MLABlock, v_dim), FIELD(MLABlock, q_lora), WEIGHT(q_a), WEIGHT(q_b), WEIGHT(kv_a),
    WEIGHT(o_proj), WEIGHT(uk), WEIGHT(uv), FIELD(MLABlock, input_norm), FIELD(MLABlock, q_a_norm),
    FIELD(MLABlock, kv_a_norm), FIELD(MLABlock, post_norm), FIELD(MLABlock, eps), FIELD(MLABlock, q_a_eps),
    FIELD(MLABlock, kv_a_eps), FIELD(MLABlock, post_eps), FIELD(MLABlock, scale), FIELD(MLABlock, style),
    FIELD(MLABlock, bf),
    STRUCT(ExpertTable), FIELD(ExpertTable, experts), FIELD(ExpertTable, inter), FIELD(ExpertTable, bits),
    FIELD(ExpertTable, mins), FIELD(ExpertTable, group), FIELD(ExpertTable, weights),
    STRUCT(MoEBlock), FIELD(MoEBlock, hidden), FIELD(MoEBlock, experts), FIELD(MoEBlock, topk),
    FIELD(MoEBlock, groups), FIELD(MoEBlock, topk_groups), FIELD(MoEBlock, sigmoid), FIELD(MoEBlock, norm),
    FIELD(MoEBlock, scaling), FIELD(MoEBlock, router), FIELD(MoEBlock, bias), FIELD(MoEBlock, bf),
    FIELD(MoEBlock, routed), FIELD(MoEBlock, shared),
    {NULL, 0, 0},
};

LS_API const ls_field *ls_struct_layout(void) { return LAYOUT; }

LS_API int ls_enable_amx(void) {
#ifdef LS_AMX
    return amx_request();
#else
    return refuse(LS_NO_AMX, "this build has no AMX code");
#endif
}
