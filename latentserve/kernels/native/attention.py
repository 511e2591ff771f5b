"""MLA attention's wrappers: the prologue (latent norm, RoPE, cache write), decode attention over the paged cache and a
decode step's whole attention block; and the checks of the cache, its slots and the decode metadata they share."""
from __future__ import annotations

import ctypes

import torch

from latentserve.config import kv_cache_row_width
from latentserve.kernels import abi
from latentserve.kernels.abi import ROPE_STYLES, MLABlock, desc
from latentserve.kernels.build import NativeKernels
from latentserve.kernels.checks import tensor
from latentserve.kernels.native.calls import (F32, I32, I64, KERNEL_DTYPES, KV_CACHE_DTYPES, block_dtype, call,
                                              refused)


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
    rope = rotary(fn, cos, sin, tokens)
    if rope >= width or rope > dim:
        raise ValueError(f"{fn}: {rope} rope dims do not fit kv's rows of {width} and q's heads of {dim}")
    if width > abi.MAX_LATENT:
        raise ValueError(f"{fn}: kv's rows of {width} (latent + rope) are wider than the {abi.MAX_LATENT} decode "
                         "attention takes")
    tensor(fn, "weight", weight, (kv.dtype,), (width - rope,))
    capacity = slots(fn, slot_mapping, tokens, kv_cache, width)
    kv_c = torch.empty(tokens, width - rope, dtype=kv.dtype)
    k_pe = torch.empty(tokens, rope, dtype=kv.dtype)
    code = call(kernels, "ls_mla_prologue", desc(q), desc(kv), desc(weight), eps, desc(cos), desc(sin),
                ROPE_STYLES.index(style), desc(kv_c), desc(k_pe), desc(kv_cache), desc(slot_mapping),
                torch.get_num_threads())
    if code == abi.SLOT_PAST_CACHE:
        raise slot_error(fn, slot_mapping, capacity)
    refused(kernels, fn, code)
    return kv_c, k_pe


def rotary(fn: str, cos: torch.Tensor, sin: torch.Tensor, tokens: int) -> int:
    """The rope dims R of fp32 cos and sin `[T, R]` (prologue.c rotates up to 1024, in pairs)."""
    rope = tensor(fn, "cos", cos, F32, (tokens, None))[1]
    tensor(fn, "sin", sin, F32, (tokens, rope))
    if rope % 2 or not 0 < rope <= abi.MAX_ROPE:
        raise ValueError(f"{fn}: cos and sin must have an even number of rope dims up to 1024, got {rope}")
    return rope


def slots(fn: str, slot_mapping: torch.Tensor, tokens: int, kv_cache: torch.Tensor, width: int) -> int:
    """The cache's slots, where it is `[blocks, block_size, kv_cache_row_width(width)]` (`KV_CACHE_DTYPES`) and the
    slots int64 `[tokens]` (the kernel checks their values: bounds.c)."""
    blocks, block_size, _ = tensor(fn, "kv_cache", kv_cache, KV_CACHE_DTYPES,
                                   (None, None, kv_cache_row_width(width, kv_cache.dtype)))
    tensor(fn, "slot_mapping", slot_mapping, I64, (tokens,))
    return blocks * block_size


def slot_error(fn: str, slot_mapping: torch.Tensor, capacity: int) -> ValueError:
    bad = int((slot_mapping >= capacity).nonzero()[0, 0])
    return ValueError(f"{fn}: slot_mapping[{bad}] = {slot_mapping[bad].item()} lies past the cache's {capacity} slots")


METADATA_ERRORS = {abi.BAD_QUERY_START: "query_start_loc must rise from >= 0 to at most the {tokens} query tokens",
                   abi.NEGATIVE_SEQ_LEN: "seq_lens must not be negative",
                   abi.SEQ_PAST_TABLE: "a sequence is longer than its row of the block table ({width} blocks of "
                                       "{block_size})",
                   abi.BLOCK_PAST_CACHE: "block_table names a block outside the cache's {blocks}"}  # bounds.c's


def decode_tables(fn: str, kv_cache: torch.Tensor, block_table: torch.Tensor, query_start_loc: torch.Tensor,
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


def metadata_error(fn: str, code: int, tokens: int, kv_cache: torch.Tensor, width: int,
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
    tokens = tensor(fn, "x", x, (block_dtype(block),), (None, block.hidden))[0]
    if rotary(fn, cos, sin, tokens) != block.rope:
        raise ValueError(f"{fn}: cos and sin must have the block's {block.rope} rope dims, got {list(cos.shape)}")
    capacity = slots(fn, slot_mapping, tokens, kv_cache, block.latent + block.rope)
    width = decode_tables(fn, kv_cache, block_table, query_start_loc, seq_lens)[1]
    y, normed = torch.empty_like(x), torch.empty_like(x)
    code = call(kernels, "ls_mla_attention_block", ctypes.byref(block), desc(x), desc(cos), desc(sin),
                desc(kv_cache), desc(block_table), desc(query_start_loc), desc(seq_lens), desc(slot_mapping),
                desc(y), desc(normed), torch.get_num_threads())
    if code == abi.SLOT_PAST_CACHE:
        raise slot_error(fn, slot_mapping, capacity)
    if code in METADATA_ERRORS:
        raise metadata_error(fn, code, tokens, kv_cache, width, query_start_loc, seq_lens)
    refused(kernels, fn, code)
    return y, normed


def mla_decode(kernels: NativeKernels, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, latent: int) -> torch.Tensor:
    """`[T, N, latent]` in q's dtype: absorbed MQA of q `[T, N, D]` over the paged cache `[blocks, block_size, D]`
    (q fp32 or bf16, the cache `KV_CACHE_DTYPES`: fp8 and int8 dequantized as they are read, an int8 cache's rows
    `kv_cache_row_width` wide), read in place through `block_table` (int32 `[R, *]`); request r's query tokens are
    query_start_loc[r] .. query_start_loc[r + 1] (int32), its length seq_lens[r] (int32)."""
    fn = "mla_decode"
    q = q.contiguous()
    tokens, heads, dim = tensor(fn, "q", q, KERNEL_DTYPES, (None, None, None))
    if dim > abi.MAX_LATENT:
        raise ValueError(f"{fn}: q's rows of {dim} (latent + rope) are wider than the {abi.MAX_LATENT} the kernel "
                         "takes")
    tensor(fn, "kv_cache", kv_cache, KV_CACHE_DTYPES, (None, None, kv_cache_row_width(dim, kv_cache.dtype)))
    if not 0 < latent <= dim:
        raise ValueError(f"{fn}: latent must be in 1..{dim} (q's and the cache's rows), got {latent}")
    width = decode_tables(fn, kv_cache, block_table, query_start_loc, seq_lens)[1]
    out = torch.empty(tokens, heads, latent, dtype=q.dtype)
    code = call(kernels, "ls_mla_decode", desc(q), desc(kv_cache), desc(block_table), desc(query_start_loc),
                desc(seq_lens), scale, desc(out), torch.get_num_threads())
    if code in METADATA_ERRORS:
        raise metadata_error(fn, code, tokens, kv_cache, width, query_start_loc, seq_lens)
    refused(kernels, fn, code)
    return out


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t `[tokens, heads, cols]` as prefill_attention reads it: unit column stride, each head and token at least a row
    apart (a view of a wider projection's columns stays a view); else a contiguous copy."""
    tokens, heads, cols = t.shape
    if t.stride(2) == 1 and t.stride(1) >= cols and t.stride(0) >= heads * cols:
        return t
    return t.contiguous()


def prefill_attention(kernels: NativeKernels, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                      distance: int, window: int | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out `[n, H, V]` in q's dtype, fp32 lse `[n, H]`): softmax attention of q `[n, H, D]` over k `[m, H, D]`, v
    `[m, H, V]` (one dtype, fp32 or bf16); query i sits `distance` positions after key 0 and sees key j where j <=
    distance + i (causal) and, with a window, j > distance + i - window. A query that sees no key: 0, lse -inf."""
    fn = "prefill_attention"
    if window is not None and not 0 < window <= abi.MAX_POSITIONS:
        raise ValueError(f"{fn}: window must be a positive number of positions (at most 2**40) or None, got {window}")
    if abs(distance) > abi.MAX_POSITIONS:
        raise ValueError(f"{fn}: distance must be within +-2**40 positions, got {distance}")
    n, heads, dim = tensor(fn, "q", q, KERNEL_DTYPES, (None, None, None), contiguous=False)
    m = tensor(fn, "k", k, (q.dtype,), (None, heads, dim), contiguous=False)[0]
    width = tensor(fn, "v", v, (q.dtype,), (m, heads, None), contiguous=False)[2]
    q, k, v = _rows(q), _rows(k), _rows(v)  # held here: a copy must outlive the call that reads its address
    out = torch.empty(n, heads, width, dtype=q.dtype)
    lse = torch.empty(n, heads, dtype=torch.float32)
    code = call(kernels, "ls_prefill_attention", desc(q), desc(k), desc(v), int(causal), distance, window or 0, scale,
                desc(out), desc(lse), torch.get_num_threads())
    refused(kernels, fn, code)
    return out, lse
