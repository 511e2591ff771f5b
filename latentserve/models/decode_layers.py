"""A decode step's decoder layers in one native call (kernels/decode_layers.c) where each of them would take its two
one-call blocks anyway (attention_block.py, moe_block.py): the same blocks chained in C with the same arguments, so
the hidden states and the caches are the layers' to the bit. What goes is each layer's Python around its two calls:
~220 us a layer on a step whose weights have streamed the Python objects out of the caches, against ~160 us a step
for the run's own checks and call.

The run is the model's last layers, from the first whose successors all qualify (DeepSeek's dense first layers run as
before, then the run). It is built once and cached (`NativeView`: rebuilt when a module's parameter, buffer or
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
from latentserve.models.native_view import NativeView


@dataclass
class LayerRun:
    """Layers start.. to the model's last in one call: their blocks, their attention cores (caches, metadata names),
    the rotary embedding they share, what each core's absorbed weights were when built, the most tokens every block
    takes."""

    start: int
    rotary: int
    cores: list[MLAAttention]
    absorbed: list[tuple]
    stack: native.LayerStack
    tokens: int
    held: list  # what the blocks point into that their modules do not hold (the MoE blocks' tables)


def _absorbed(core: MLAAttention) -> tuple:
    return core.W_UK_T, core.W_UV, core.int8_absorbed


def build_run(layers: Sequence[nn.Module], layer_rotary: Sequence[int],
              dtype: torch.dtype) -> tuple[LayerRun | None, list[torch.Tensor]]:
    """(the run of the model's last layers that each have both one-call blocks (`decode_blocks`) on one build of the
    kernels and one rotary embedding, or None; every tensor it reads by address)."""
    blocks = [getattr(layer, "decode_blocks", lambda _: None)(dtype) for layer in layers]
    start = len(layers)
    while start > 0 and blocks[start - 1] is not None and layer_rotary[start - 1] == layer_rotary[-1]:
        start -= 1
    if start == len(layers):
        return None, []
    cores = [layer.self_attn.attn for layer in layers[start:]]
    isas = {core.kernels.isa for core in cores} | {layer.mlp.gate.route_kernels.isa for layer in layers[start:]}
    if len(isas) != 1:
        return None, []
    attention, moe = zip(*blocks[start:])
    run = LayerRun(start, layer_rotary[-1], cores, [_absorbed(core) for core in cores],
                   native.LayerStack.of([a[0] for a in attention], [m[0] for m in moe]),
                   min(n for a, m in zip(attention, moe) for n in (a[1], m[1])), [m[2] for m in moe])
    return run, [t for a in run.absorbed for t in a if isinstance(t, torch.Tensor)]


def layer_run(view: NativeView[LayerRun], layers: Sequence[nn.Module], layer_rotary: Sequence[int],
              hidden: torch.Tensor) -> LayerRun | None:
    """The model's run of last layers (cached in `view`) where this step's tokens `hidden` may take it, else None."""
    tokens = hidden.shape[0]
    if not hidden.is_cpu or tokens == 0 or in_dbo():
        return None
    run = view.get((hidden.dtype,), lambda: build_run(layers, layer_rotary, hidden.dtype))
    if run is None or tokens > run.tokens:
        return None
    metadata = get_forward_context().attn_metadata
    md = metadata.get(run.cores[0].layer_name)
    if md is None or md.prefill is not None or md.decode is None or md.dsa is not None or \
            md.num_actual_tokens != tokens:
        return None
    for core, absorbed in zip(run.cores, run.absorbed):
        if metadata.get(core.layer_name) is not md or core.kv_cache is None or \
                any(a is not b for a, b in zip(_absorbed(core), absorbed)) or \
                not core.decode_backend.runs_natively(core.kv_cache):
            return None
    return run


def run_layers(run: LayerRun, cos: torch.Tensor, sin: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The hidden states after the run's layers, `hidden` entering the first (a step `layer_run` accepted)."""
    core = run.cores[0]
    md = get_forward_context().attn_metadata[core.layer_name]
    d = md.decode
    return native.decode_layers(core.kernels, run.stack, hidden.contiguous(), cos.contiguous(), sin.contiguous(),
                                [c.kv_cache for c in run.cores], d.block_table, d.query_start_loc, d.seq_lens,
                                md.slot_mapping)
