"""Paged latent KV cache: one `[num_blocks, block_size, kv_lora_rank + rope_dim]` tensor per MLA layer, plus the
extra per-layer caches a layer asks for (`extra_cache_dims`: DSA's indexer keys), on the same block table."""
from __future__ import annotations

import math
import mmap
from typing import Mapping

import torch


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
        if dtype == torch.float8_e4m3fn and layer.extra_cache_dims:
            raise ValueError(f"{name}: an fp8 KV cache is not supported with the extra caches "
                             f"{sorted(layer.extra_cache_dims)} (DSA's indexer keys); use kv_cache_dtype auto, "
                             "bfloat16 or float32")
        if layer.kv_source is not None:  # reads its source layer's cache (registered, so allocated, before it)
            layer.kv_cache = caches[layer.kv_source]
            if layer.kv_cache.shape[-1] != layer.mla.kv_cache_dim:
                raise ValueError(f"{name} reads the cache of {layer.kv_source}, whose rows are "
                                 f"{layer.kv_cache.shape[-1]} wide, not its {layer.mla.kv_cache_dim}")
        else:
            dim = layer.mla.kv_cache_dim
            caches[name] = layer.kv_cache = _zeros((num_blocks, block_size, dim), dtype, torch.device(device))
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
    write_cache_rows(kv_cache, torch.cat([kv_c, k_pe], dim=-1), slot_mapping)


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
