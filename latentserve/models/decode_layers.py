"""A decode step's decoder layers in one native call (kernels/decode_layers.c) where each of them would take its two
one-call blocks anyway (attention_block.py, moe_block.py): the same blocks chained in C with the same arguments, so
the hidden states and the caches are the layers' to the bit. What goes is each layer's Python around its two calls:
~220 us a layer on a step whose weights have streamed the Python objects out of the caches, against ~160 us a step
for the run's own checks and call.

The run is the model's last layers, from the first whose successors all qualify. A dense layer's MLP qualifies for
one token, where its module runs the experts kernel over it alone (the MoE block of no routed experts does the
same): so a batch-1 step runs DeepSeek's dense first layers in the call too, a larger one starts after them. It is
built once and cached (`NativeView`: rebuilt when a module's parameter, buffer or
submodule is replaced); each step checks what the layers' own calls would: decode tokens only and few enough, one
metadata for all the run's layers, each layer's cache bound and read natively, its absorbed weights the ones built
in (plain attributes, compared by identity), and no DBO (whose ubatches yield inside each MoE block)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from latentserve.attention.mla import MLAAttention
from latentserve.forward_context import get_forward_context, in_dbo
from latentserve.kernels import native
from latentserve.layers.moe import MoE
from latentserve.models.native_view import NativeView


@dataclass
class Stack:
    """Layers first.. to the model's last as one call reads them: the rotary embedding they share, their attention
    cores (caches, metadata names), their blocks, the most tokens every block takes."""

    first: int
    rotary: int
    cores: list[MLAAttention]
    blocks: native.LayerStack
    tokens: int


@dataclass
class LayerRun:
    """The model's last layers that run as one call, for one token (`one`: dense layers' MLPs among them, which
    match their modules for one token only) and for more (`many`: from the first layer after the last dense one; None
    where that is past the end); what each core's absorbed weights were when built (plain attributes: compared by
    identity each step)."""

    one: Stack
    many: Stack | None
    absorbed: list[tuple]
    held: list  # what the blocks point into that their modules do not hold (the MoE blocks' tables)


def _absorbed(core: MLAAttention) -> tuple:
    return core.W_UK_T, core.W_UV, core.int8_absorbed


def _stack(layers: Sequence[nn.Module], blocks: list, first: int, rotary: int) -> Stack:
    attention, mlp = zip(*blocks[first:])
    return Stack(first, rotary, [layer.self_attn.attn for layer in layers[first:]],
                 native.LayerStack.of([a[0] for a in attention], [m[0] for m in mlp]),
                 min(n for a, m in zip(attention, mlp) for n in (a[1], m[1])))


def build_run(layers: Sequence[nn.Module], layer_rotary: Sequence[int],
              dtype: torch.dtype) -> tuple[LayerRun | None, list[torch.Tensor]]:
    """(the run of the model's last layers that each have both one-call blocks (`decode_blocks`) on one build of the
    kernels and one rotary embedding, or None; every tensor it reads by address)."""
    blocks = [getattr(layer, "decode_blocks", lambda _: None)(dtype) for layer in layers]
    first = len(layers)
    while first > 0 and blocks[first - 1] is not None and layer_rotary[first - 1] == layer_rotary[-1]:
        first -= 1
    if first == len(layers):
        return None, []
    cores = [layer.self_attn.attn for layer in layers[first:]]
    mlps = [layer.mlp.gate.route_kernels if isinstance(layer.mlp, MoE) else layer.mlp.gate_up_proj.kernels
            for layer in layers[first:]]
    if len({kernels.isa for kernels in (*(core.kernels for core in cores), *mlps)}) != 1:
        return None, []
    wide = next((i for i in range(len(layers), first, -1) if blocks[i - 1][1][1] == 1), first)
    rotary = layer_rotary[-1]
    run = LayerRun(_stack(layers, blocks, first, rotary),
                   _stack(layers, blocks, wide, rotary) if wide < len(layers) else None,
                   [_absorbed(core) for core in cores], [b[1][2] for b in blocks[first:]])
    return run, [t for a in run.absorbed for t in a if isinstance(t, torch.Tensor)]


def layer_run(view: NativeView[LayerRun], layers: Sequence[nn.Module], layer_rotary: Sequence[int],
              hidden: torch.Tensor) -> Stack | None:
    """The model's last layers (cached in `view`) where this step's tokens `hidden` may take them in one call, else
    None."""
    tokens = hidden.shape[0]
    if not hidden.is_cpu or tokens == 0 or in_dbo():
        return None
    run = view.get((hidden.dtype,), lambda: build_run(layers, layer_rotary, hidden.dtype))
    if run is None:
        return None
    stack = run.one if tokens == 1 else run.many
    if stack is None or tokens > stack.tokens:
        return None
    metadata = get_forward_context().attn_metadata
    md = metadata.get(stack.cores[0].layer_name)
    if md is None or md.prefill is not None or md.decode is None or md.dsa is not None or \
            md.num_actual_tokens != tokens:
        return None
    for core, absorbed in zip(run.one.cores, run.absorbed):
        if metadata.get(core.layer_name) is not md or core.kv_cache is None or \
                any(a is not b for a, b in zip(_absorbed(core), absorbed)) or \
                not core.decode_backend.runs_natively(core.kv_cache):
            return None
    return stack


def run_layers(stack: Stack, cos: torch.Tensor, sin: torch.Tensor, hidden: torch.Tensor,
               norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """The hidden states after the stack's layers, `hidden` entering the first (a step `layer_run` accepted), normed
    by `norm` (weight, eps: `RMSNorm.native_norm`'s) where given."""
    core = stack.cores[0]
    md = get_forward_context().attn_metadata[core.layer_name]
    d = md.decode
    return native.decode_layers(core.kernels, stack.blocks, hidden.contiguous(), cos.contiguous(), sin.contiguous(),
                                [c.kv_cache for c in stack.cores], d.block_table, d.query_start_loc, d.seq_lens,
                                md.slot_mapping, norm)
