"""The wrapper of a decode step's decoder layers in one call (decode_layers.c): each layer's attention block and MoE
block, as `mla_attention_block` and `moe_block` run them one call at a time."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from latentserve.kernels import abi
from latentserve.kernels.abi import MLABlock, MoEBlock, desc
from latentserve.kernels.build import NativeKernels
from latentserve.kernels.checks import tensor
from latentserve.kernels.native.attention import (METADATA_ERRORS, decode_tables, metadata_error, rotary,
                                                  slot_error, slots)
from latentserve.kernels.native.calls import block_dtype, call, refused


@dataclass
class LayerStack:
    """Layers' blocks as ls_decode_layers reads them: arrays of pointers to each layer's MLABlock and MoEBlock (the
    structs themselves held by whoever built them, alive as long as this)."""

    attention: ctypes.Array
    moe: ctypes.Array
    blocks: tuple[list[MLABlock], list[MoEBlock]]

    @classmethod
    def of(cls, attention: list[MLABlock], moe: list[MoEBlock]) -> LayerStack:
        if not attention or len(attention) != len(moe):
            raise ValueError(f"a layer stack needs one MoE block a layer, got {len(attention)} attention blocks and "
                             f"{len(moe)} MoE blocks")
        pointers = lambda kind, blocks: (ctypes.POINTER(kind) * len(blocks))(*map(ctypes.pointer, blocks))  # noqa: E731
        return cls(pointers(MLABlock, attention), pointers(MoEBlock, moe), (attention, moe))


def decode_layers(kernels: NativeKernels, stack: LayerStack, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  kv_caches: list[torch.Tensor], block_table: torch.Tensor, query_start_loc: torch.Tensor,
                  seq_lens: torch.Tensor, slot_mapping: torch.Tensor,
                  norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """The hidden states after the stack's layers, for decode tokens x `[T, hidden]` (contiguous, the blocks' dtype)
    entering the first: per layer h = x + attention(input_norm(x)) with the layer's cache (its tokens' latents
    written to it), then x = h + moe(post_norm(h)); the caches one dtype and shape, the metadata as
    `mla_attention_block` reads it. With `norm` (weight `[hidden]` in the blocks' dtype, eps) the last layer's
    output comes back normed as `rms_norm` norms it."""
    fn = "decode_layers"
    first = stack.blocks[0][0]
    if len(kv_caches) != len(stack.blocks[0]):
        raise ValueError(f"{fn}: {len(stack.blocks[0])} layers need as many caches, got {len(kv_caches)}")
    tokens = tensor(fn, "x", x, (block_dtype(first),), (None, first.hidden))[0]
    if rotary(fn, cos, sin, tokens) != first.rope:
        raise ValueError(f"{fn}: cos and sin must have the blocks' {first.rope} rope dims, got {list(cos.shape)}")
    capacity = [slots(fn, slot_mapping, tokens, cache, block.latent + block.rope)
                for cache, block in zip(kv_caches, stack.blocks[0])]
    width = decode_tables(fn, kv_caches[0], block_table, query_start_loc, seq_lens)[1]
    if norm is not None:
        tensor(fn, "the final norm's weight", norm[0], (x.dtype,), (first.hidden,))
    y = torch.empty_like(x)
    code = call(kernels, "ls_decode_layers", stack.attention, stack.moe, b"".join(map(desc, kv_caches)),
                len(kv_caches), desc(x), desc(cos), desc(sin), desc(block_table), desc(query_start_loc),
                desc(seq_lens), desc(slot_mapping), None if norm is None else desc(norm[0]),
                0.0 if norm is None else norm[1], desc(y), torch.get_num_threads())
    if code == abi.SLOT_PAST_CACHE:
        raise slot_error(fn, slot_mapping, min(capacity))
    if code == abi.BAD_EXPERT:
        raise ValueError(f"{fn}: the routing chose an expert outside those a layer's MoE block holds")
    if code in METADATA_ERRORS:
        raise metadata_error(fn, code, tokens, kv_caches[0], width, query_start_loc, seq_lens)
    refused(kernels, fn, code)
    return y
