/* latentserve's kernels: the whole C interface. Everything the Python side (native.py) passes or fills is declared
 * here: the tensor descriptor, the structs of the fused blocks, their enums and limits, the status codes and every
 * exported `ls_` function. The build hides every other symbol (-fvisibility=hidden); simd.h, quant.h and kv_rows.h
 * are the kernels' own. native.py mirrors this file in ctypes and checks the mirror at load (`ls_struct_layout`). */
#pragma once

#include <stdint.h>

#define LS_API __attribute__((visibility("default")))

/* LS_INT8_ROW_SCALES: the bytes an int8 latent cache row carries after its values, two fp32 scales (kv_rows.h).
 * LS_MAX_LATENT: the widest cache row (latent + rope) the prologue writes and decode attention takes: each decode
 * item keeps its heads' scaled queries and sums on its thread's stack (mla_tiles.h decode_item; 2048: 128 KB), the
 * prologue a row, and wider rows would overrun it (DeepSeek's rows are 576). */
enum { LS_MAX_DIMS = 5, LS_MAX_ROPE = 1024, LS_INT8_ROW_SCALES = 8, LS_MAX_LATENT = 2048 };

/* Element types a descriptor names (torch's float32, bfloat16, float8_e4m3fn, int8, uint8, int32, int64). */
typedef enum { LS_F32 = 0, LS_BF16 = 1, LS_F8_E4M3 = 2, LS_I8 = 3, LS_U8 = 4, LS_I32 = 5, LS_I64 = 6 } ls_dtype;

/* A tensor as the kernels take it: its data, element type, shape and strides (in elements). Every entry point
 * reads sizes and dtypes from these and refuses (LS_BAD_TENSOR) a NULL pointer, a dtype it does not read, a rank
 * or a size that does not fit the other arguments, or strides that are not the contiguous ones (block tables: a
 * unit column stride). */
typedef struct {
    void *data;
    int32_t dtype, ndim;
    int64_t shape[LS_MAX_DIMS], strides[LS_MAX_DIMS];
} ls_tensor;

/* What an entry point returns: 0, or why it computed and wrote nothing. 1..4: the decode metadata
 * (bounds.c's decode_metadata_error), 5: a cache slot past the cache (bad_slot). */
typedef enum {
    LS_OK = 0,
    LS_BAD_QUERY_START = 1, /* query_start_loc not rising from >= 0 to at most the query tokens */
    LS_NEGATIVE_SEQ_LEN = 2,
    LS_SEQ_PAST_TABLE = 3,  /* a sequence longer than its row of the block table */
    LS_BLOCK_PAST_CACHE = 4,
    LS_SLOT_PAST_CACHE = 5,
    LS_BAD_EXPERT = 6,      /* the routing chose an expert the block does not hold */
    LS_BAD_TENSOR = 7,      /* a descriptor or block struct the kernel does not read (see ls_tensor) */
    LS_NO_MEMORY = 8,       /* the scratch arena could not grow */
    LS_BAD_BLOCK = 9,       /* an MLABlock or MoEBlock lacks a pointer it needs or has sizes that do not fit */
    LS_NO_AMX = 10,         /* ls_enable_amx: no AMX build, CPU or permission from the OS */
} ls_status;

/* How one projection's weight is stored (Weight.kind). DENSE: w `[N, K]` in the block's dtype (per-head products:
 * bmm's `[H, K, N]`); INT8: w int8 `[H, N, K]` (per-head products), per-row scale (fp32) and sum (int32);
 * INT8_LANES: the same in ls_int8_heads_lanes' layout; INT8_BLOCKS: w in `pack_int8`'s layout (linear layers);
 * INT4: w in `pack_int4`'s layout with its group size; Q6K: w in `pack_q6k`'s layout, group 16; Q50: w in
 * `pack_q50`'s layout, group 32; Q5K: w in `pack_q5k`'s layout, group 256; Q4K: w in `pack_q4k`'s layout, group
 * 256; Q51: w in `pack_q51`'s layout, group 32; Q2K: w in `pack_q2k`'s layout, group 16; Q3K: w in `pack_q3k`'s
 * layout, group 16. */
typedef enum {
    LS_DENSE = 0, LS_INT8 = 1, LS_INT4 = 2, LS_INT8_LANES = 3, LS_INT8_BLOCKS = 4, LS_Q6K = 5, LS_Q50 = 6, LS_Q5K = 7,
    LS_Q4K = 8, LS_Q51 = 9, LS_Q2K = 10, LS_Q3K = 11
} ls_weight_kind;

/* DeepSeek's rope layouts (layers/rotary.py): rotated pairs (2j, 2j + 1), interleaved pairs read as halves, halves. */
typedef enum { LS_ROPE_GPTJ = 0, LS_ROPE_INTERLEAVE = 1, LS_ROPE_NEOX = 2 } ls_rope_style;

typedef struct {
    int32_t kind; /* ls_weight_kind */
    const void *w, *scale, *qsum;
    int64_t group;
} Weight;

/* One layer's attention: shapes (q_lora 0: q_b is q_proj), weights, norm weights (the activations' dtype;
 * post_norm is the MLP's input norm) and epsilons, the softmax scale, the rope style, whether activations are
 * bf16 (else fp32). */
typedef struct {
    int64_t hidden, heads, nope, rope, latent, v_dim, q_lora;
    Weight q_a, q_b, kv_a, o_proj, uk, uv;
    const void *input_norm, *q_a_norm, *kv_a_norm, *post_norm;
    float eps, q_a_eps, kv_a_eps, post_eps, scale;
    int32_t style, bf;
} MLABlock;

/* A set of experts of one shape and one format per projection: `experts` of them, intermediate size `inter`; per expert
 * two pointers in `weights`: gate_up `[2 * inter, K]` (gate's rows, then up's) and down `[K, inter]`. bits: gate_up's,
 * down's (32 fp32 rows, 16 bf16 rows, 8 `pack_int8`'s layout, 4 `pack_int4`'s with group size group, 6 `pack_q6k`'s
 * with group 16, 3 `pack_q3k`'s with group 16, 5 `pack_q50`'s with group 32 or `pack_q5k`'s with group 256, 4 with
 * group 256 `pack_q4k`'s, 2 `pack_q2k`'s with group 16); mins: 1 where bits 5, group 32 is `pack_q51`'s (Q5_1: a
 * minimum beside each d), else 0. */
typedef struct {
    int64_t experts, inter;
    int32_t bits[2], mins[2];
    int64_t group[2];
    void *const *weights;
} ExpertTable;

/* One layer's MoE: shapes and routing (ls_route's arguments), the fp32 router `[experts, hidden]`, the bias or
 * NULL, whether activations are bf16, the routed experts (`experts` of them) and the shared ones (as one expert of
 * their whole width; shared.experts 0: none). experts 0: a dense layer's MLP, in `shared` (one expert; topk, groups,
 * topk_groups, sigmoid, norm 0, scaling 1, router, bias NULL, routed empty): y = residual + that MLP's output. */
typedef struct {
    int64_t hidden, experts, topk, groups, topk_groups;
    int32_t sigmoid, norm;
    float scaling;
    const float *router, *bias;
    int32_t bf;
    ExpertTable routed, shared;
} MoEBlock;

/* One row of the layout table: "Struct" with its size, or "Struct.field" with its offset and size. */
typedef struct {
    const char *name;
    int64_t offset, size;
} ls_field;

/* The layout of every struct above, ending with a NULL name: native.py refuses a library whose layout differs from
 * its ctypes mirror. */
LS_API const ls_field *ls_struct_layout(void);
/* The most scratch memory one calling thread may hold (0: no limit, the default): beyond it a call returns
 * LS_NO_MEMORY, as it does when the system has no more. */
LS_API void ls_set_scratch_limit(int64_t bytes);
/* How far ahead (bytes; 0 or less: not at all) the few-row weight products fetch their weight stream into L1 (quant.h
 * read_ahead). The loader sets it once, before any kernel runs; the results are the same bits whatever it is. */
LS_API void ls_set_read_ahead(int64_t bytes);
/* Why this thread's last call returned LS_BAD_TENSOR or LS_BAD_BLOCK, naming the argument or field. */
LS_API const char *ls_last_error(void);
/* The avx512_amx build's AMX tiles made usable in this process (Linux grants their state on request): LS_OK, or
 * LS_NO_AMX with ls_last_error saying why (another build, a CPU without AMX-INT8, the OS's refusal). The loader
 * calls it once before any kernel. */
LS_API int ls_enable_amx(void);

/* Each returns an ls_status. `threads`: the OpenMP threads to run on. Activations are fp32 or bf16; an output's
 * dtype is its descriptor's. */
/* y [M, N] = x [M, K] @ w [N, K]^T, fp32 sums; w fp32 or bf16. */
LS_API int ls_dense_linear(const ls_tensor *x, const ls_tensor *w, const ls_tensor *y, int threads);
/* y [M, H, N] = x [M, H, K] @ w [H, K, N] per head (N a multiple of 16), fp32 sums. */
LS_API int ls_dense_heads(const ls_tensor *x, const ls_tensor *w, const ls_tensor *y, int threads);
/* y [M, (H,) N] = x [M, (H,) K] times the int8 q [(H,) N, K] with per-row fp32 scale and int32 qsum [(H *) N]. */
LS_API int ls_int8_heads(const ls_tensor *x, const ls_tensor *q, const ls_tensor *scale, const ls_tensor *qsum,
                         const ls_tensor *y, int threads);
/* The same with q in the lanes layout [H, N / 16, K / 4, 16, 4]. */
LS_API int ls_int8_heads_lanes(const ls_tensor *x, const ls_tensor *q, const ls_tensor *scale, const ls_tensor *qsum,
                               const ls_tensor *y, int threads);
/* y [M, N] = x [M, K] times the int8 weight in pack_int8's layout [ceil(N / 16), 128 + 16 K] (K a multiple of 4). */
LS_API int ls_int8_linear(const ls_tensor *x, const ls_tensor *packed, const ls_tensor *y, int threads);
/* y [M, N] = x [M, K] times the uint8 weight in pack_int4's layout [ceil(N / 16), K / group * (64 + 8 group)]. */
LS_API int ls_int4_linear(const ls_tensor *x, const ls_tensor *packed, int64_t group, const ls_tensor *y, int threads);
/* y [M, N] = x [M, K] times the uint8 weight in pack_q6k's layout [ceil(N / 16), K / 256 * 3392] (K % 256 == 0). */
LS_API int ls_q6k_linear(const ls_tensor *x, const ls_tensor *packed, const ls_tensor *y, int threads);
/* y [M, N] = x [M, K] times the uint8 weight in pack_q2k's layout [ceil(N / 16), K / 256 * 1408] (K % 256 == 0). */
LS_API int ls_q2k_linear(const ls_tensor *x, const ls_tensor *packed, const ls_tensor *y, int threads);
/* y [M, N] = x [M, K] times the uint8 weight in pack_q3k's layout [ceil(N / 16), K / 256 * 1856] (K % 256 == 0). */
LS_API int ls_q3k_linear(const ls_tensor *x, const ls_tensor *packed, const ls_tensor *y, int threads);
/* y [M, N] = x [M, K] times the uint8 weight in pack_q50's layout [ceil(N / 16), K / 32 * 352] (K % 64 == 0). */
LS_API int ls_q50_linear(const ls_tensor *x, const ls_tensor *packed, const ls_tensor *y, int threads);
/* y [M, N] = x [M, K] times the uint8 weight in pack_q51's layout [ceil(N / 16), K / 32 * 384] (K % 64 == 0). */
LS_API int ls_q51_linear(const ls_tensor *x, const ls_tensor *packed, const ls_tensor *y, int threads);
/* y [M, N] = x [M, K] times the uint8 weight in pack_q5k's layout [ceil(N / 16), K / 256 * 2944] (K % 256 == 0). */
LS_API int ls_q5k_linear(const ls_tensor *x, const ls_tensor *packed, const ls_tensor *y, int threads);
/* y [M, N] = x [M, K] times the uint8 weight in pack_q4k's layout [ceil(N / 16), K / 256 * 2432] (K % 256 == 0). */
LS_API int ls_q4k_linear(const ls_tensor *x, const ls_tensor *packed, const ls_tensor *y, int threads);
/* RMSNorm over x's rows [M, N] with w [N] of x's dtype; y like x. */
LS_API int ls_rms_norm(const ls_tensor *x, const ls_tensor *w, float eps, const ls_tensor *y, int threads);
/* out int64 [M] = the index of each row's first maximum of fp32 x [M, V], V >= 1 (argmax.c: torch.argmax's, a NaN
 * the maximum). */
LS_API int ls_argmax(const ls_tensor *x, const ls_tensor *out, int threads);
/* MLA's latent prologue (prologue.c): q [T, H, D] rotated in place, kv [T, L + R] -> kv_c [T, L], k_pe [T, R],
 * each token's row to kv_cache [blocks, block_size, L + R] at slots [T] (int64, < 0: padding). A cache is fp32,
 * bf16, fp8 e4m3 or int8; an int8 cache's rows are L + R + LS_INT8_ROW_SCALES wide (kv_rows.h). */
LS_API int ls_mla_prologue(const ls_tensor *q, const ls_tensor *kv, const ls_tensor *w, float eps,
                           const ls_tensor *cos, const ls_tensor *sin, int style, const ls_tensor *kv_c,
                           const ls_tensor *k_pe, const ls_tensor *kv_cache, const ls_tensor *slots, int threads);
/* Absorbed MQA over the paged cache (mla_decode.c): out [T, H, L] from q [T, H, D], kv_cache [blocks, B, D] (int8:
 * D + LS_INT8_ROW_SCALES),
 * block_table int32 [>= R, width], query_start_loc int32 [R + 1], seq_lens int32 [R]. */
LS_API int ls_mla_decode(const ls_tensor *q, const ls_tensor *kv_cache, const ls_tensor *block_table,
                         const ls_tensor *query_start_loc, const ls_tensor *seq_lens, float scale,
                         const ls_tensor *out, int threads);
/* Prefill attention (prefill_attention.c): out [n, H, V] (contiguous) and fp32 lse [n, H] from q [n, H, D], k [m, H, D]
 * and v [m, H, V] of one dtype, each with unit column stride and its heads and tokens at least a row apart; query i
 * sees key j where j <= distance + i (causal) and j > distance + i - window (window > 0). A query that sees no key
 * gets 0 and lse -inf. distance and window: at most LS_MAX_POSITIONS from 0. */
#define LS_MAX_POSITIONS (1LL << 40)
LS_API int ls_prefill_attention(const ls_tensor *q, const ls_tensor *k, const ls_tensor *v, int causal,
                                int64_t distance, int64_t window, float scale, const ls_tensor *out,
                                const ls_tensor *lse, int threads);
/* MoE routing (route.c): weights fp32 and ids int64 [T, k] from fp32 logits [T, E]; bias [E] or NULL. */
LS_API int ls_route(const ls_tensor *logits, int sigmoid, int64_t groups, int64_t topk_groups, const ls_tensor *bias,
                    int norm, float scaling, const ls_tensor *weights, const ls_tensor *ids);
/* A decode step's attention block (attention_block.c): y and y_normed like x [T, hidden]; the rest as
 * ls_mla_prologue and ls_mla_decode take them. */
LS_API int ls_mla_attention_block(const MLABlock *block, const ls_tensor *x, const ls_tensor *cos,
                                  const ls_tensor *sin, const ls_tensor *kv_cache, const ls_tensor *block_table,
                                  const ls_tensor *query_start_loc, const ls_tensor *seq_lens,
                                  const ls_tensor *slots, const ls_tensor *y, const ls_tensor *y_normed, int threads);
/* A decode step's MoE block (moe_block.c): y = residual + moe(x), all three [T, hidden] in the block's dtype. */
LS_API int ls_moe_block(const MoEBlock *block, const ls_tensor *x, const ls_tensor *residual, const ls_tensor *y,
                        int threads);
/* A decode step's decoder layers in one call (decode_layers.c): for each layer l, h = ls_mla_attention_block's y
 * and y_normed with attention[l] and kv_caches[l], then x of layer l + 1 = ls_moe_block(moe[l], y_normed, h); y gets
 * the last layer's, or with a final norm (`norm` [hidden] in the blocks' dtype, else NULL) ls_rms_norm's of it. The
 * blocks of one dtype and hidden size, the caches (`layers` descriptors) of one dtype and shape; the rest as
 * ls_mla_attention_block takes it. */
LS_API int ls_decode_layers(const MLABlock *const *attention, const MoEBlock *const *moe, const ls_tensor *kv_caches,
                            int64_t layers, const ls_tensor *x, const ls_tensor *cos, const ls_tensor *sin,
                            const ls_tensor *block_table, const ls_tensor *query_start_loc, const ls_tensor *seq_lens,
                            const ls_tensor *slots, const ls_tensor *norm, float eps, const ls_tensor *y, int threads);

/* The experts (experts.c): y [T, K] = for each token of x [T, K], round(round(sum_j weights[t, j] *
 * routed[ids[t, j]](x[t])) + round(shared(x[t]))), the routed experts in increasing id order, rounding to y's dtype
 * (as torch adds the two; no shared experts: round(routed sum)). ids int64 and weights fp32 [T, k]; shared NULL or
 * of experts 0: none, else 1. LS_BAD_EXPERT where an id is outside the table. */
LS_API int ls_experts(const ExpertTable *routed, const ExpertTable *shared, const ls_tensor *x, const ls_tensor *ids,
                      const ls_tensor *weights, const ls_tensor *y, int threads);
