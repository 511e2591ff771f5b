"""Paged latent KV cache: one `[num_blocks, block_size, kv_lora_rank + rope_dim]` tensor per MLA layer (an int8
cache's rows 8 bytes wider: their scales, `kv_cache_row_width`), plus the extra per-layer caches a layer asks for
(`extra_cache_dims`: DSA's indexer keys), on the same block table."""
from __future__ import annotations

import math
import mmap
from typing import Mapping

import torch

from latentserve.config import INT8_KV_SCALE_BYTES, kv_cache_row_width


def allocate_kv_caches(
    static_ctx: Mapping[str, object],
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Allocate a cache for every MLA layer in the static forward context and bind it to the layer, and its extra
    caches (named `{layer}.{cache}` in the result) to `layer.extra_caches`."""
    if num_blocks <= 0 or block_size <= 0:
        raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
    caches = {}
    for name, layer in static_ctx.items():
        if dtype in (torch.float8_e4m3fn, torch.int8) and layer.extra_cache_dims:
            kind = "an fp8" if dtype == torch.float8_e4m3fn else "an int8"
            raise ValueError(f"{name}: {kind} KV cache is not supported with the extra caches "
                             f"{sorted(layer.extra_cache_dims)} (DSA's indexer keys); use kv_cache_dtype auto, "
                             "bfloat16 or float32")
        width = kv_cache_row_width(layer.mla.kv_cache_dim, dtype)
        if layer.kv_source is not None:  # reads its source layer's cache (registered, so allocated, before it)
            layer.kv_cache = caches[layer.kv_source]
            if layer.kv_cache.shape[-1] != width:
                raise ValueError(f"{name} reads the cache of {layer.kv_source}, whose rows are "
                                 f"{layer.kv_cache.shape[-1]} wide, not its {width}")
        else:
            caches[name] = layer.kv_cache = _zeros((num_blocks, block_size, width), dtype, torch.device(device))
        layer.kv_cache_dtype = dtype  # builders size their workspaces from it
        for extra, extra_dim in layer.extra_cache_dims.items():
            cache = _zeros((num_blocks, block_size, extra_dim), dtype, torch.device(device))
            caches[f"{name}.{extra}"] = layer.extra_caches[extra] = cache
    return caches


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros; on the CPU in fresh anonymous pages, which the kernel zeroes as they are first written: a pool sized
    for the worst case costs neither start-up time (torch.zeros writes every byte: ~0.3 s a GiB) nor memory until
    its blocks are used."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    return torch.frombuffer(mmap.mmap(-1, max(count * dtype.itemsize, 1)), dtype=dtype, count=count).view(shape)


def write_kv_cache(
    kv_cache: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store each token's `[c_kv ‖ k_pe]` at its slot; slot -1 marks padding and is skipped."""
    rows = quantize_int8_rows(kv_c, k_pe) if kv_cache.dtype == torch.int8 else torch.cat([kv_c, k_pe], dim=-1)
    write_cache_rows(kv_cache, rows, slot_mapping)


def quantize_int8_rows(kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """int8 cache rows `[T, L + R + 8]` as kernels/kv_rows.h writes them, to the byte: each part at the scale of its
    largest magnitude (amax / 127), its values divided by it and rounded to nearest even, then the two fp32 scales."""
    values, scales = [], []
    for part in (kv_c.float(), k_pe.float()):
        amax = part.abs().amax(dim=-1, keepdim=True) if part.shape[-1] else part.new_zeros(part.shape[0], 1)
        scale = amax / 127
        values.append(torch.where(scale > 0, torch.round(part / scale), 0).clamp(-127, 127).to(torch.int8))
        scales.append(scale)
    return torch.cat([*values, torch.cat(scales, dim=-1).view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, latent: int, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows (any leading dims) as `dtype` values `[..., L + R]`: an int8 cache's values times their part's
    scale (c_kv's for the first `latent`, k_pe's after), in fp32 as the kernels compute them; other caches' cast."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    values = rows[..., :-INT8_KV_SCALE_BYTES].float()
    scales = rows[..., -INT8_KV_SCALE_BYTES:].contiguous().view(torch.float32)
    values[..., :latent] *= scales[..., :1]
    values[..., latent:] *= scales[..., 1:]
    return values.to(dtype)


FP8_MAX = 448.0  # e4m3's largest finite value: an fp8 cache saturates there, as kernels/kv_rows.h does


def write_cache_rows(cache: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store each token's row of a paged cache at its slot; slot -1 marks padding and is skipped. An fp8 (e4m3)
    cache takes the rows rounded to nearest even, saturated to +-448, at scale 1.0."""
    flat = cache.view(-1, cache.shape[-1])
    if cache.dtype == torch.float8_e4m3fn:  # torch has no index_copy_ for fp8: its bytes are copied
        rows, flat = rows.clamp(-FP8_MAX, FP8_MAX).to(cache.dtype).view(torch.uint8), flat.view(torch.uint8)
    else:
        rows = rows.to(cache.dtype)
    keep = slot_mapping >= 0
    if bool(keep.all()):
        flat.index_copy_(0, slot_mapping, rows)
    else:
        flat.index_copy_(0, slot_mapping[keep], rows[keep])


def slots_for_positions(block_table_row: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat cache slots of token positions of one request."""
    return block_table_row[positions // block_size].long() * block_size + positions % block_size


def gather_kv_cache(kv_cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of the cache at flat `slots`, into `out` when given (a bounded workspace, at least as wide as a row: a
    workspace serves layers of different cache widths, each viewing it as rows of its own)."""
    width = kv_cache.shape[-1]
    flat = kv_cache.view(-1, width)
    if out is None:
        return flat.index_select(0, slots)
    if out.shape[-1] < width:
        raise ValueError(f"a workspace of {out.shape[-1]}-wide rows cannot hold cache rows of {width}")
    rows = out.view(-1)[: slots.numel() * width].view(-1, width)
    return torch.index_select(flat, 0, slots, out=rows)
