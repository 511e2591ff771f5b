"""latentserve's own CPU kernels, called through ctypes (qgemm.c, int4.c, quant_blocks.c: quantized linears;
experts.c: the experts in every format; gemv.c: fp32/bf16 linears for few rows; mla_decode.c: decode attention over
the paged cache; norm.c: RMSNorm; prologue.c: MLA's latent norm, RoPE and cache write; attention_block.c: a decode step's whole MLA attention
block; route.c: MoE routing; moe_block.c: a decode step's whole MoE block). Built and loaded by build.py; the
interface is latentserve.h, mirrored by abi.py; every wrapper here checks what it passes first (checks.py's boundary
rule) and passes tensors as descriptors."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from latentserve.config import kv_cache_row_width
# The kernels are reached through this module: callers ask it for them and for their build.
from latentserve.kernels.build import (CACHE_ENV, FALLBACK, NATIVE_ENV, NativeKernels,  # noqa: F401
                                       kernel_isa, load, native_kernels, runnable_isas)
from latentserve.kernels.abi import (DENSE, INT4, INT8, INT8_BLOCKS, INT8_LANES, ROPE_STYLES,  # noqa: F401
                                     ExpertTable, MLABlock, MoEBlock, Weight, desc)
from latentserve.kernels import abi
from latentserve.kernels.checks import tensor

KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # what the kernels read and write; other dtypes go through fp32
KV_CACHE_DTYPES = (*KERNEL_DTYPES, torch.float8_e4m3fn, torch.int8)  # the latent caches they read and write (kv_rows.h)
F32, I8, I32, I64, U8 = (torch.float32,), (torch.int8,), (torch.int32,), (torch.int64,), (torch.uint8,)
PROFILE_PREFIX = "latentserve::"  # the profiler range each call gets while a torch profiler runs


def _call(kernels: NativeKernels, name: str, *args):
    """kernels.lib.`name`(*args) and what it returns, inside a profiler range named after it while torch's profiler
    runs (ctypes calls are invisible to it otherwise)."""
    fn = getattr(kernels.lib, name)
    # The profiler's module-level flag: torch.autograd._profiler_enabled() stays False under an all-threads profile.
    if torch.autograd.profiler._is_profiler_enabled:
        with torch.profiler.record_function(PROFILE_PREFIX + name):
            return fn(*args)
    return fn(*args)


def _refused(kernels: NativeKernels, fn: str, code: int) -> None:
    """Raise what a nonzero ls_status the wrappers do not explain themselves means: the descriptor or block struct
    the kernel refused (ls_last_error names it), or a MemoryError."""
    if code == abi.NO_MEMORY:
        raise MemoryError(f"{fn}: the kernels' scratch arena could not grow")
    if code:
        raise ValueError(f"{fn}: {kernels.lib.ls_last_error().decode()} (status {code})")


def activations(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """x as the kernels take it: `[rows, in_features]`, contiguous, fp32 or bf16."""
    x = x.reshape(-1, in_features)
    return (x if x.dtype in KERNEL_DTYPES else x.float()).contiguous()


def _out(out_dtype: torch.dtype) -> torch.dtype:
    """The output's dtype: `out_dtype` where the kernels write it, else fp32."""
    return out_dtype if out_dtype in KERNEL_DTYPES else torch.float32


def int8_linear(kernels: NativeKernels, x: torch.Tensor, packed: torch.Tensor, out_features: int,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`[M, out_features]` = x `[M, K]` (`activations`) times the int8 weight `packed` by `pack_int8`; in `out_dtype`
    where the kernels write it, else fp32."""
    m, k = tensor("int8_linear", "x", x, KERNEL_DTYPES, (None, None))
    _check_int8("int8_linear", "packed", packed, out_features, k)
    y = torch.empty(m, out_features, dtype=_out(out_dtype))
    _refused(kernels, "int8_linear", _call(kernels, "ls_int8_linear", desc(x), desc(packed), desc(y),
                                           torch.get_num_threads()))
    return y


def _int8_scales(fn: str, scale: torch.Tensor, qsum: torch.Tensor, rows: int) -> None:
    tensor(fn, "scale", scale, F32, numel=rows)
    tensor(fn, "qsum", qsum, I32, numel=rows)


def _int8(kernels: NativeKernels, name: str, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
          qsum: torch.Tensor, shape: tuple[int, ...], out_dtype: torch.dtype) -> torch.Tensor:
    """y of `shape` from kernel `name` (ls_int8_heads or its lanes form), the arguments checked."""
    y = torch.empty(shape, dtype=_out(out_dtype))
    _refused(kernels, name, _call(kernels, name, desc(x), desc(q), desc(scale), desc(qsum), desc(y),
                                  torch.get_num_threads()))
    return y


def int8_heads(kernels: NativeKernels, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, qsum: torch.Tensor,
               out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`[M, H, N]`: y[m, h] = x[m, h] @ w[h]^T for x `[M, H, K]` (contiguous, fp32 or bf16), the int8 weights q
    `[H, N, K]` with per-row `scale` and `qsum` (q.sum(-1), int32) `[H, N]`."""
    m, h, k = tensor("int8_heads", "x", x, KERNEL_DTYPES, (None, None, None))
    _, n, _ = tensor("int8_heads", "q", q, I8, (h, None, k))
    _int8_scales("int8_heads", scale, qsum, h * n)
    return _int8(kernels, "ls_int8_heads", x, q, scale, qsum, (m, h, n), out_dtype)


def int8_lanes(q: torch.Tensor) -> torch.Tensor:
    """int8 q `[H, N, K]` (N % 16 == 0, K % 4 == 0) in `int8_heads_lanes`' layout `[H, N / 16, K / 4, 16, 4]`."""
    h, n, k = q.shape
    if q.dtype != torch.int8 or n % 16 or k % 4:
        raise ValueError(f"int8_lanes takes int8 [H, N, K] with N % 16 == 0 and K % 4 == 0, not {q.dtype} "
                         f"{tuple(q.shape)}")
    return q.view(h, n // 16, 16, k // 4, 4).transpose(2, 3).contiguous()


def int8_heads_lanes(kernels: NativeKernels, x: torch.Tensor, lanes: torch.Tensor, scale: torch.Tensor,
                     qsum: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`int8_heads` with the weight in `int8_lanes`' layout: the same outputs, short rows read as one stream."""
    m, h, k = tensor("int8_heads_lanes", "x", x, KERNEL_DTYPES, (None, None, None))
    if k % 4:
        raise ValueError(f"int8_heads_lanes: x's rows of {k} are not a multiple of 4 columns (int8_lanes' layout)")
    n = tensor("int8_heads_lanes", "lanes", lanes, I8, (h, None, k // 4, 16, 4))[1] * 16
    _int8_scales("int8_heads_lanes", scale, qsum, h * n)
    return _int8(kernels, "ls_int8_heads_lanes", x, lanes, scale, qsum, (m, h, n), out_dtype)


def dense_linear(kernels: NativeKernels, x: torch.Tensor, weight: torch.Tensor,
                 out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`[M, N]` = x `[M, K]` (`activations`) @ weight`[N, K]`ᵀ for a contiguous fp32 or bf16 weight, fp32 sums; in
    `out_dtype` where the kernels write it, else fp32."""
    m, k = tensor("dense_linear", "x", x, KERNEL_DTYPES, (None, None))
    n, _ = tensor("dense_linear", "weight", weight, KERNEL_DTYPES, (None, k))
    y = torch.empty(m, n, dtype=_out(out_dtype))
    _refused(kernels, "dense_linear", _call(kernels, "ls_dense_linear", desc(x), desc(weight), desc(y),
                                            torch.get_num_threads()))
    return y


def dense_heads(kernels: NativeKernels, x: torch.Tensor, w: torch.Tensor,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`[M, H, N]`: y[m, h] = x[m, h] @ w[h] for x `[M, H, K]` (contiguous, fp32 or bf16) and a contiguous fp32 or
    bf16 w `[H, K, N]` (bmm's layout) with N a multiple of 16; fp32 sums."""
    m, h, k = tensor("dense_heads", "x", x, KERNEL_DTYPES, (None, None, None))
    n = tensor("dense_heads", "w", w, KERNEL_DTYPES, (h, k, None))[2]
    if n % 16:
        raise ValueError(f"dense_heads: w [H, K, N] must have N % 16 == 0, got {list(w.shape)}")
    y = torch.empty(m, h, n, dtype=_out(out_dtype))
    _refused(kernels, "dense_heads", _call(kernels, "ls_dense_heads", desc(x), desc(w), desc(y),
                                           torch.get_num_threads()))
    return y


def rms_norm(kernels: NativeKernels, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over x's last dimension in fp32, x and `weight` both fp32 or both bf16 (bf16: the normalized x
    rounds to bf16 before the weight multiplies it); in x's dtype and shape."""
    shape = tensor("rms_norm", "x", x, KERNEL_DTYPES, contiguous=False)
    if not shape:
        raise ValueError("rms_norm: x must have at least one dimension, got a scalar")
    tensor("rms_norm", "weight", weight, (x.dtype,), (shape[-1],))
    rows = x.reshape(-1, shape[-1]).contiguous()
    y = torch.empty_like(rows)
    _refused(kernels, "rms_norm", _call(kernels, "ls_rms_norm", desc(rows), desc(weight), eps, desc(y),
                                        torch.get_num_threads()))
    return y.view(x.shape)


def mla_prologue(kernels: NativeKernels, q: torch.Tensor, kv: torch.Tensor, weight: torch.Tensor, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor, style: str, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_c `[T, L]`, k_pe `[T, R]`) in kv's dtype: RMSNorm(kv[:, :L]) * weight and RoPE(kv[:, L:]) from the kv_a
    projection kv `[T, L + R]`; q `[T, H, D]` (contiguous) gets its last R dims of each head rotated in place; each
    token's [kv_c ‖ k_pe] goes to the cache `[blocks, block_size, L + R]` at its slot (int64, -1 = padding). cos,
    sin `[T, R]` fp32 as `RotaryEmbedding.cos_sin` makes them, for rope `style`. q, kv, weight of one dtype, fp32 or
    bf16; the cache `KV_CACHE_DTYPES` (fp8: rounded to nearest even, saturated to +-448; int8: rows
    `kv_cache_row_width` wide, quantized as `attention.kv_cache.quantize_int8_rows`)."""
    fn = "mla_prologue"
    if style not in ROPE_STYLES:
        raise ValueError(f"{fn}: rope style must be one of {ROPE_STYLES}, got {style!r}")
    tokens, width = tensor(fn, "kv", kv, KERNEL_DTYPES, (None, None))
    heads, dim = tensor(fn, "q", q, (kv.dtype,), (tokens, None, None))[1:]
    cos, sin, slot_mapping = cos.contiguous(), sin.contiguous(), slot_mapping.contiguous()
    rope = _rotary(fn, cos, sin, tokens)
    if rope >= width or rope > dim:
        raise ValueError(f"{fn}: {rope} rope dims do not fit kv's rows of {width} and q's heads of {dim}")
    tensor(fn, "weight", weight, (kv.dtype,), (width - rope,))
    capacity = _slots(fn, slot_mapping, tokens, kv_cache, width)
    kv_c = torch.empty(tokens, width - rope, dtype=kv.dtype)
    k_pe = torch.empty(tokens, rope, dtype=kv.dtype)
    code = _call(kernels, "ls_mla_prologue", desc(q), desc(kv), desc(weight), eps, desc(cos), desc(sin),
                 ROPE_STYLES.index(style), desc(kv_c), desc(k_pe), desc(kv_cache), desc(slot_mapping),
                 torch.get_num_threads())
    if code == abi.SLOT_PAST_CACHE:
        raise _slot_error(fn, slot_mapping, capacity)
    _refused(kernels, fn, code)
    return kv_c, k_pe


def _rotary(fn: str, cos: torch.Tensor, sin: torch.Tensor, tokens: int) -> int:
    """The rope dims R of fp32 cos and sin `[T, R]` (prologue.c rotates up to 1024, in pairs)."""
    rope = tensor(fn, "cos", cos, F32, (tokens, None))[1]
    tensor(fn, "sin", sin, F32, (tokens, rope))
    if rope % 2 or not 0 < rope <= abi.MAX_ROPE:
        raise ValueError(f"{fn}: cos and sin must have an even number of rope dims up to 1024, got {rope}")
    return rope


def _slots(fn: str, slot_mapping: torch.Tensor, tokens: int, kv_cache: torch.Tensor, width: int) -> int:
    """The cache's slots, where it is `[blocks, block_size, kv_cache_row_width(width)]` (`KV_CACHE_DTYPES`) and the
    slots int64 `[tokens]` (the kernel checks their values: bounds.c)."""
    blocks, block_size, _ = tensor(fn, "kv_cache", kv_cache, KV_CACHE_DTYPES,
                                   (None, None, kv_cache_row_width(width, kv_cache.dtype)))
    tensor(fn, "slot_mapping", slot_mapping, I64, (tokens,))
    return blocks * block_size


def _slot_error(fn: str, slot_mapping: torch.Tensor, capacity: int) -> ValueError:
    bad = int((slot_mapping >= capacity).nonzero()[0, 0])
    return ValueError(f"{fn}: slot_mapping[{bad}] = {slot_mapping[bad].item()} lies past the cache's {capacity} slots")


METADATA_ERRORS = {abi.BAD_QUERY_START: "query_start_loc must rise from >= 0 to at most the {tokens} query tokens",
                   abi.NEGATIVE_SEQ_LEN: "seq_lens must not be negative",
                   abi.SEQ_PAST_TABLE: "a sequence is longer than its row of the block table ({width} blocks of "
                                       "{block_size})",
                   abi.BLOCK_PAST_CACHE: "block_table names a block outside the cache's {blocks}"}  # bounds.c's


def _decode_tables(fn: str, kv_cache: torch.Tensor, block_table: torch.Tensor, query_start_loc: torch.Tensor,
                   seq_lens: torch.Tensor) -> tuple[int, int]:
    """(requests, the block table's width) where the tables have the shapes and dtypes the kernel reads (it checks
    their values: bounds.c); else a ValueError."""
    block_size = kv_cache.shape[1]
    requests = tensor(fn, "seq_lens", seq_lens, I32, (None,))[0]
    tensor(fn, "query_start_loc", query_start_loc, I32, (requests + 1,))
    rows, width = tensor(fn, "block_table", block_table, I32, (None, None), contiguous=False)
    if rows < requests or block_table.stride(1) != 1 or block_size < 1:
        raise ValueError(f"{fn}: block_table must be int32 [requests={requests}, *] with unit column stride and the "
                         f"cache's blocks non-empty, got {list(block_table.shape)} strides {block_table.stride()} "
                         f"and a cache {list(kv_cache.shape)}")
    return requests, width


def _metadata_error(fn: str, code: int, tokens: int, kv_cache: torch.Tensor, width: int,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> ValueError:
    blocks, block_size = kv_cache.shape[:2]
    why = METADATA_ERRORS[code].format(tokens=tokens, width=width, block_size=block_size, blocks=blocks)
    return ValueError(f"{fn}: {why}; got query_start_loc {query_start_loc.tolist()}, seq_lens {seq_lens.tolist()}")


def mla_attention_block(kernels: NativeKernels, block: MLABlock, x: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, post_norm(y)) with y = x + o_proj(MLA attention(input_norm(x))), for decode tokens x `[T, hidden]`
    (contiguous, the block's dtype), their latents written to the cache; metadata as `mla_decode` and
    `mla_prologue` read it."""
    fn = "mla_attention_block"
    tokens = tensor(fn, "x", x, (_block_dtype(block),), (None, block.hidden))[0]
    if _rotary(fn, cos, sin, tokens) != block.rope:
        raise ValueError(f"{fn}: cos and sin must have the block's {block.rope} rope dims, got {list(cos.shape)}")
    capacity = _slots(fn, slot_mapping, tokens, kv_cache, block.latent + block.rope)
    width = _decode_tables(fn, kv_cache, block_table, query_start_loc, seq_lens)[1]
    y, normed = torch.empty_like(x), torch.empty_like(x)
    code = _call(kernels, "ls_mla_attention_block", ctypes.byref(block), desc(x), desc(cos), desc(sin),
                 desc(kv_cache), desc(block_table), desc(query_start_loc), desc(seq_lens), desc(slot_mapping),
                 desc(y), desc(normed), torch.get_num_threads())
    if code == abi.SLOT_PAST_CACHE:
        raise _slot_error(fn, slot_mapping, capacity)
    if code in METADATA_ERRORS:
        raise _metadata_error(fn, code, tokens, kv_cache, width, query_start_loc, seq_lens)
    _refused(kernels, fn, code)
    return y, normed


def _block_dtype(block: MLABlock | MoEBlock) -> torch.dtype:
    return torch.bfloat16 if block.bf else torch.float32


def moe_block(kernels: NativeKernels, block: MoEBlock, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + moe(x) for a few tokens x `[T, hidden]` and the residual stream (both contiguous, the block's
    dtype)."""
    dtype = (_block_dtype(block),)
    tokens = tensor("moe_block", "x", x, dtype, (None, block.hidden))[0]
    tensor("moe_block", "residual", residual, dtype, (tokens, block.hidden))
    y = torch.empty_like(residual)
    code = _call(kernels, "ls_moe_block", ctypes.byref(block), desc(x), desc(residual), desc(y),
                 torch.get_num_threads())
    if code == abi.BAD_EXPERT:
        raise ValueError(f"moe_block: the routing chose an expert outside the {block.experts} the block holds")
    _refused(kernels, "moe_block", code)
    return y


def route(kernels: NativeKernels, logits: torch.Tensor, k: int, sigmoid: bool, groups: int, topk_groups: int,
          bias: torch.Tensor | None, norm: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights `[T, k]` fp32, expert ids `[T, k]` int64) from fp32 router logits `[T, E]`: softmax or sigmoid scores
    (+ bias `[E]` to choose, not to weigh), the best `topk_groups` of `groups` equal groups kept (softmax: a group's
    best score; sigmoid: its best two), the top k, weights divided by their sum (`norm`) and scaled."""
    logits = logits.contiguous()
    bias = bias.contiguous() if bias is not None else None
    tokens, experts = tensor("route", "logits", logits, F32, (None, None))
    if (not 0 < topk_groups <= groups or experts % groups or not 0 < k <= topk_groups * (experts // groups)
            or (bias is not None and bias.shape != (experts,))):
        raise ValueError(f"route: {k} of {experts} experts from the best {topk_groups} of {groups} groups cannot be "
                         f"chosen (bias {None if bias is None else tuple(bias.shape)})")
    if bias is not None:
        tensor("route", "bias", bias, F32, (experts,))
    weights, ids = torch.empty(tokens, k), torch.empty(tokens, k, dtype=torch.int64)
    _refused(kernels, "route", _call(kernels, "ls_route", desc(logits), int(sigmoid), groups, topk_groups,
                                     None if bias is None else desc(bias), int(norm), scaling, desc(weights),
                                     desc(ids)))
    return weights, ids


def int4_linear(kernels: NativeKernels, x: torch.Tensor, packed: torch.Tensor, group_size: int, out_features: int,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`[M, out_features]` = x `[M, K]` (`activations`) times the int4 weight `packed` by `pack_int4`; in `out_dtype`
    where the kernels write it, else fp32."""
    m, k = tensor("int4_linear", "x", x, KERNEL_DTYPES, (None, None))
    _check_int4("int4_linear", "packed", packed, out_features, k, group_size)
    y = torch.empty(m, out_features, dtype=_out(out_dtype))
    _refused(kernels, "int4_linear", _call(kernels, "ls_int4_linear", desc(x), desc(packed), group_size, desc(y),
                                           torch.get_num_threads()))
    return y


# A weight's format as the experts read it: (32, 0) fp32 rows, (16, 0) bf16 rows, (8, 0) `pack_int8`'s layout,
# (4, group size) `pack_int4`'s.
Format = tuple[int, int]
DENSE_FORMATS = {torch.float32: (32, 0), torch.bfloat16: (16, 0)}


@dataclass
class Experts:
    """A set of experts as `experts` reads them: the table, their hidden size and what the table points into."""

    table: ExpertTable
    hidden: int
    held: list


def expert_table(weights: list[tuple[torch.Tensor, torch.Tensor]], hidden: int, inter: int,
                 formats: tuple[Format, Format]) -> Experts:
    """The experts whose (gate_up, down) are `weights`: gate_up `[2 * inter, hidden]` (gate's rows, then up's) and
    down `[hidden, inter]`, each projection of every expert in its one format (`formats`: gate_up's, down's; dense
    ones as `[N, K]` contiguous rows of the format's dtype, quantized ones packed), each checked here."""
    fn = "expert_table"
    if not weights or any(f not in (*DENSE_FORMATS.values(), (8, 0)) and f[0] != 4 for f in formats):
        raise ValueError(f"{fn} takes at least one expert in formats (32, 0), (16, 0), (8, 0) or (4, group size); got "
                         f"{len(weights)} experts, formats {formats}")
    dense = {f: (d,) for d, f in DENSE_FORMATS.items()}
    for e, pair in enumerate(weights):
        for which, (w, fmt) in enumerate(zip(pair, formats)):
            n, k = (2 * inter, hidden) if which == 0 else (hidden, inter)
            name = f"experts[{e}].{('gate_up', 'down')[which]}"
            if fmt in dense:
                tensor(fn, name, w, dense[fmt], (n, k))
            else:
                _check_packed(fn, name, w, n, k, fmt)
    pointers = (ctypes.c_void_p * (2 * len(weights)))(*(w.data_ptr() for pair in weights for w in pair))
    table = ExpertTable(len(weights), inter, (ctypes.c_int32 * 2)(*(f[0] for f in formats)),
                        (ctypes.c_int64 * 2)(*(f[1] for f in formats)), ctypes.addressof(pointers))
    return Experts(table, hidden, [pointers, *(w for pair in weights for w in pair)])


def experts(kernels: NativeKernels, x: torch.Tensor, routed: Experts, ids: torch.Tensor, weights: torch.Tensor,
            shared: Experts | None = None) -> torch.Tensor:
    """`[T, K]` in x's dtype (fp32 or bf16): each token of x `[T, K]` (contiguous) through its routed experts ids
    `[T, k]` (int64, rows of `routed`) in increasing id order, summed in fp32 with `weights` `[T, k]` (fp32), rounded
    to x's dtype; plus, rounded too, the `shared` experts' output (one expert), as torch adds the two. Each token's
    result is what it would be alone."""
    fn = "experts"
    tokens = tensor(fn, "x", x, KERNEL_DTYPES, (None, routed.hidden))[0]
    ids, weights = ids.contiguous(), weights.contiguous()  # held here: a temporary's memory goes with its last use
    k = tensor(fn, "ids", ids, I64, (tokens, None))[1]
    tensor(fn, "weights", weights, F32, (tokens, k))
    if shared is not None and (shared.table.experts != 1 or shared.hidden != routed.hidden):
        raise ValueError(f"{fn}: the shared experts must be one expert of hidden size {routed.hidden}; got "
                         f"{shared.table.experts} of {shared.hidden}")
    y = torch.empty(tokens, routed.hidden, dtype=x.dtype)
    code = _call(kernels, "ls_experts", ctypes.byref(routed.table), None if shared is None else ctypes.byref(
        shared.table), desc(x), desc(ids), desc(weights), desc(y), torch.get_num_threads())
    if code == abi.BAD_EXPERT:
        raise ValueError(f"{fn}: the table holds experts 0..{routed.table.experts - 1}, got ids {ids.tolist()}")
    _refused(kernels, fn, code)
    return y


def _check_packed(fn: str, name: str, packed: torch.Tensor, n: int, k: int, fmt: Format) -> None:
    if fmt[0] == 8:
        _check_int8(fn, name, packed, n, k)
    else:
        _check_int4(fn, name, packed, n, k, fmt[1])


def mla_decode(kernels: NativeKernels, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, latent: int) -> torch.Tensor:
    """`[T, N, latent]` in q's dtype: absorbed MQA of q `[T, N, D]` over the paged cache `[blocks, block_size, D]`
    (q fp32 or bf16, the cache `KV_CACHE_DTYPES`: fp8 and int8 dequantized as they are read, an int8 cache's rows
    `kv_cache_row_width` wide), read in place through `block_table` (int32 `[R, *]`); request r's query tokens are
    query_start_loc[r] .. query_start_loc[r + 1] (int32), its length seq_lens[r] (int32)."""
    fn = "mla_decode"
    q = q.contiguous()
    tokens, heads, dim = tensor(fn, "q", q, KERNEL_DTYPES, (None, None, None))
    tensor(fn, "kv_cache", kv_cache, KV_CACHE_DTYPES, (None, None, kv_cache_row_width(dim, kv_cache.dtype)))
    if not 0 < latent <= dim:
        raise ValueError(f"{fn}: latent must be in 1..{dim} (q's and the cache's rows), got {latent}")
    width = _decode_tables(fn, kv_cache, block_table, query_start_loc, seq_lens)[1]
    out = torch.empty(tokens, heads, latent, dtype=q.dtype)
    code = _call(kernels, "ls_mla_decode", desc(q), desc(kv_cache), desc(block_table), desc(query_start_loc),
                 desc(seq_lens), scale, desc(out), torch.get_num_threads())
    if code in METADATA_ERRORS:
        raise _metadata_error(fn, code, tokens, kv_cache, width, query_start_loc, seq_lens)
    _refused(kernels, fn, code)
    return out


INT4_BLOCK = INT8_BLOCK = 16  # outputs per block of `pack_int4`'s and `pack_int8`'s layouts
INT8_HEADER = 128  # bytes before a `pack_int8` block's weights: 16 fp32 scales, 16 int32 sums of q


def pack_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 `[ceil(N / 16), 128 + 16 * K]` from q int8 `[N, K]` (K a multiple of 4) and its fp32 `scale` `[N]`: the
    outputs in blocks of 16 (zero rows pad the last), each block the 16 scales, the 16 int32 sums of q's rows, then
    per 4 columns 64 bytes whose byte 4j + i is output j's column 4c + i (`int8_lanes`; qgemm.c)."""
    n, k = q.shape
    if q.dtype != torch.int8 or k % 4 or scale.shape != (n,):
        raise ValueError(f"pack_int8 takes int8 q [N, K] with K % 4 == 0 and fp32 scale [N], not {q.dtype} "
                         f"{tuple(q.shape)} and {tuple(scale.shape)}")
    pad = -n % INT8_BLOCK
    q, scale = torch.nn.functional.pad(q, (0, 0, 0, pad)), torch.nn.functional.pad(scale.float(), (0, pad))
    blocks = (n + pad) // INT8_BLOCK
    header = torch.cat([scale.view(blocks, INT8_BLOCK), q.sum(dim=1, dtype=torch.int32).view(torch.float32)
                        .view(blocks, INT8_BLOCK)], dim=1).view(torch.int8)
    return torch.cat([header, int8_lanes(q[None])[0].view(blocks, -1)], dim=1)


def unpack_int8(packed: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q `[n, k]`, scale `[n]`) back from `pack_int8`'s layout."""
    blocks = packed.shape[0]
    scale = packed[:, :64].contiguous().view(torch.float32).reshape(-1)[:n]
    lanes = packed[:, INT8_HEADER:].reshape(blocks, k // 4, INT8_BLOCK, 4)
    return lanes.transpose(1, 2).reshape(blocks * INT8_BLOCK, k)[:n], scale


def _check_int8(fn: str, name: str, packed: torch.Tensor, n: int, k: int) -> None:
    """A weight in `pack_int8`'s layout of n outputs and k inputs, or a ValueError naming what differs."""
    if k % 4:
        raise ValueError(f"{fn}: the int8 kernels take K a multiple of 4; got K {k}")
    tensor(fn, f"{name} (int8 weight of {n} outputs, {k} inputs in pack_int8's layout)", packed, I8,
           (-(-n // INT8_BLOCK), INT8_HEADER + INT8_BLOCK * k))


def pack_int4(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """uint8 `[ceil(N / 16), groups * (64 + 8 * G)]` from q `[N, K]` in [0, 15] (K a multiple of 64) and fp32
    `scale`, `minimum` `[N, groups]` (G = K / groups): the outputs in blocks of 16 (zero rows pad the last), each
    block per group the 16 (scale, minimum) bf16 pairs, then per 8 columns 64 bytes whose byte 4j + i holds output
    j's column i (low nibble) and 4 + i (high) (int4.c)."""
    (n, k), groups = q.shape, scale.shape[1]
    g, pad = k // groups, -n % INT4_BLOCK
    q, scale, minimum = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, scale, minimum))
    blocks = (n + pad) // INT4_BLOCK
    units = q.view(blocks, INT4_BLOCK, groups, g // 8, 2, 4)  # [block, output, group, unit, low/high, column]
    nibbles = (units[..., 0, :] | (units[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).reshape(blocks, groups, 8 * g)
    pairs = torch.stack([scale, minimum], dim=-1).to(torch.bfloat16).view(torch.uint8)  # [N, groups, 4]
    pairs = pairs.view(blocks, INT4_BLOCK, groups, 4).transpose(1, 2).reshape(blocks, groups, 64)
    return torch.cat([pairs, nibbles], dim=2).view(blocks, -1)


def _check_int4(fn: str, name: str, packed: torch.Tensor, n: int, k: int, group_size: int) -> None:
    """A weight in `pack_int4`'s layout of n outputs and k inputs, or a ValueError naming what differs."""
    if group_size not in (32, 64, 128) or k % 64 or k % group_size:
        raise ValueError(f"{fn}: int4 kernels take group size 32, 64 or 128 dividing K, K a multiple of 64; got group "
                         f"size {group_size}, K {k}")
    expected = (-(-n // INT4_BLOCK), k // group_size * (64 + 8 * group_size))
    tensor(fn, f"{name} (int4 weight of {n} outputs, {k} inputs, group size {group_size} in pack_int4's layout)",
           packed, U8, expected)
