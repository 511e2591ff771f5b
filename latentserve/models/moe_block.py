"""A decode step's DeepSeek MoE block, from the router to the residual, in one native call (kernels/moe_block.c)
where every piece would run latentserve's kernels anyway: the router's fp32 product, the native routing, and either
the experts kernel over the stacked fp32/bf16 experts (as far as the modules' router takes the same kernel; their
shared experts folded in or none) or the quantized int8/int4 experts and shared MLP (gate_up in one format and down
in another where the checkpoint has them so), up to 8 tokens. The kernel chains those same kernels, so the result is
the modules' to the bit where they run them; experts chosen by several tokens are read once for all of them, and each
token's result is what it would be alone. Elsewhere (longer prefills, larger batches, expert parallelism, experts
with a bias) the modules run.
The view is cached per layer (`NativeView`); the layer's tensors are parameters and buffers, so any replacement
rebuilds it. A dense layer's quantized MLP has a view too (`native_dense`: the block of no routed experts), which only
the decode run of whole layers takes (models/decode_layers.py): the layer's own forward calls its module.
"""
from __future__ import annotations

import torch
from torch import nn

from latentserve.forward_context import dbo_yield
from latentserve.kernels import native
from latentserve.layers.mlp import GatedMLP
from latentserve.layers.moe import NATIVE_MAX_TOKENS, MoE
from latentserve.layers.normed_moe import NormedMoE
from latentserve.layers.quant.experts import mlp_table, quantized_table
from latentserve.models.native_view import NativeView

Built = tuple[native.MoEBlock, int, object]  # the kernel's view, up to how many tokens, what its pointers point into


def _quantized(moe: MoE, block: native.MoEBlock, kernels: native.NativeKernels) -> list | None:
    """Fills in the quantized experts and shared MLP (`quantized_table`'s kinds, on `kernels`' build): what the block
    reads by address, or None."""
    shared = [] if moe.shared_experts is None else [moe.shared_experts]
    tables = [quantized_table(list(moe.experts)), *(quantized_table(shared) for _ in shared)]
    if None in tables or any(layer.kernels.isa != kernels.isa for mlp in (*moe.experts, *shared)
                             for layer in (mlp.gate_up_proj, mlp.down_proj)):
        return None
    block.routed = tables[0].table
    if shared:
        block.shared = tables[1].table
    return tables


def build_moe_block(moe: MoE, dtype: torch.dtype) -> tuple[Built | None, list[torch.Tensor]]:
    """(the layer's MoE as the kernel reads it, chained from its router's and its experts' own descriptions (each
    chosen once from the loader's `KernelPolicy`), or None where a piece does not run latentserve's kernels; every
    tensor it reads by address)."""
    router = moe.gate.native_router(dtype)
    if router is None:
        return None, []
    block, router_rows, tensors = router
    kernels, stack = moe.gate.route_kernels, moe.stacked
    if stack is not None and stack.w13.shape[0] == len(moe.experts):  # every expert in this one stack
        held = stack.native_stack(block, dtype, kernels, with_shared=moe.shared_experts is not None)
        if held is not None:
            return (block, min(NATIVE_MAX_TOKENS, router_rows), held), tensors + held
    held = _quantized(moe, block, kernels)
    if held is None:
        return None, tensors
    return (block, NATIVE_MAX_TOKENS, held), tensors + held


def native_moe(moe: MoE, view: NativeView, dtype: torch.dtype) -> Built | None:
    """The layer's MoE block as the kernel reads it for `dtype` activations (`view`: cached, built once after the
    weights are loaded and again only when one is replaced), or None where the modules run it."""
    if (dtype not in native.KERNEL_DTYPES or moe.expert_parallel is not None or moe.swiglu_limit is not None
            or moe.gate.route_kernels is None):  # (the kernel has no clamp)
        return None
    return view.get((dtype,), lambda: build_moe_block(moe, dtype))


def native_dense(mlp: GatedMLP, view: NativeView, dtype: torch.dtype) -> Built | None:
    """A dense layer's MLP as the MoE block of no routed experts reads it (its `shared` table), for one token: what
    the module runs for one token (`tokens_mlp`: the experts kernel over it alone at weight 1), or None where the
    module runs other kernels."""
    if dtype not in native.KERNEL_DTYPES or mlp.gate_up_proj is None or mlp.swiglu_limit is not None:
        return None
    return view.get((dtype,), lambda: _dense_block(mlp, dtype))


def _dense_block(mlp: GatedMLP, dtype: torch.dtype) -> tuple[Built | None, list[torch.Tensor]]:
    table = mlp_table(mlp)  # the module's own one-token table
    if table is None:
        return None, []
    block = native.MoEBlock(hidden=table.hidden, experts=0, topk=0, scaling=1.0, bf=int(dtype == torch.bfloat16),
                            shared=table.table)
    return (block, 1, table), [table]


def fused_moe(moe: MoE, view: NativeView, normed: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor | None:
    """hidden + moe(normed) in one native call (`view`: the layer's `native_moe`), or None where the modules must
    run it."""
    tokens = normed.shape[0]
    if normed.device.type != "cpu" or not 0 < tokens <= NATIVE_MAX_TOKENS:
        return None
    built = native_moe(moe, view, normed.dtype)
    if built is None or tokens > built[1]:
        return None
    # An output norm sits between the experts' sum and the residual: the block adds a zero residual (exactly the
    # sum) and the norm and residual follow, as in the modules.
    norm = moe.post_mlp_layernorm if isinstance(moe, NormedMoE) else None
    dbo_yield()  # where MoE.forward yields: before its experts, after them
    y = native.moe_block(moe.gate.route_kernels, built[0], normed.contiguous(),
                         hidden.contiguous() if norm is None else torch.zeros_like(hidden))
    dbo_yield()
    return y if norm is None else hidden + norm(y)
