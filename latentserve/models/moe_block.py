"""A decode step's DeepSeek MoE block, from the router to the residual, in one native call (kernels/moe_block.c)
where every piece would run latentserve's kernels anyway: the router's fp32 product, the native routing, and either
the stacked fp32/bf16 experts (up to 3 tokens, as far as the modules' router takes the same kernel; their shared
experts folded in or none) or quantized int8/int4 experts and shared MLP (up to 8 tokens; gate_up in one format and
down in another where the checkpoint has them so). The kernel chains those
same kernels, so the result is the modules' to the bit where they run them (stacked experts; quantized ones at one
token); at 2-8 tokens quantized experts chosen by several tokens are read once for all of them, and each token's
result is what it would be alone. Elsewhere (longer prefills, larger batches, expert parallelism, experts with a
bias) the modules run.
The view is cached per layer (`NativeView`); the layer's tensors are parameters and buffers, so any replacement
rebuilds it.
"""
from __future__ import annotations

import ctypes

import torch
from torch import nn

from latentserve.forward_context import dbo_yield
from latentserve.kernels import native
from latentserve.layers.moe import NATIVE_MAX_TOKENS, MoE
from latentserve.layers.normed_moe import NormedMoE
from latentserve.layers.quant.experts import packed_format
from latentserve.models.native_view import NativeView

Built = tuple[native.MoEBlock, int, object]  # the kernel's view, up to how many tokens, what its pointers point into


def _quantized_layers(mlp: nn.Module, kernels: native.NativeKernels) -> tuple[nn.Module, nn.Module] | None:
    """(gate_up, down) of a gated MLP whose two layers are latentserve's quantized kinds (each its own), bias-free."""
    layers = (getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None))
    if any(packed_format(layer) is None or layer.kernels.isa != kernels.isa for layer in layers):
        return None
    return layers


def _formats(layers: tuple[nn.Module, nn.Module]) -> tuple[native.Format, native.Format]:
    return packed_format(layers[0]), packed_format(layers[1])


def _quantized(moe: MoE, block: native.MoEBlock, kernels: native.NativeKernels) -> tuple[int, object, list] | None:
    """Fills in the quantized experts: (tokens it runs, its pointer tables, their tensors), or None."""
    experts = [_quantized_layers(e, kernels) for e in moe.experts]
    shared = [] if moe.shared_experts is None else [_quantized_layers(moe.shared_experts, kernels)]
    if any(layers is None for layers in experts + shared):
        return None
    if len({_formats(layers) for layers in experts}) != 1:
        return None  # the routed experts in one call: one format for every gate_up, one for every down
    formats = _formats(experts[0])
    block.bits[:], block.group[:] = [f[0] for f in formats], [f[1] for f in formats]
    block.inter = experts[0][0].out_features // 2
    if any(layers[0].out_features != 2 * block.inter for layers in experts):
        return None
    tensors = [layer.packed for layers in experts for layer in layers]
    table = (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))
    block.table, tables = ctypes.addressof(table), [table]
    if shared:
        shared_tensors = [layer.packed for layer in shared[0]]
        tables.append((ctypes.c_void_p * 2)(*(t.data_ptr() for t in shared_tensors)))
        block.shared, block.shared_inter = ctypes.addressof(tables[-1]), shared[0][0].out_features // 2
        shared_formats = _formats(shared[0])
        block.shared_bits[:], block.shared_group[:] = [f[0] for f in shared_formats], [f[1] for f in shared_formats]
        tensors += shared_tensors
    return NATIVE_MAX_TOKENS, tables, tensors


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
    quantized = _quantized(moe, block, kernels)
    if quantized is None:
        return None, tensors
    tokens, tables, held = quantized
    return (block, tokens, tables), tensors + held


def native_moe(moe: MoE, view: NativeView, dtype: torch.dtype) -> Built | None:
    """The layer's MoE block as the kernel reads it for `dtype` activations (`view`: cached, built once after the
    weights are loaded and again only when one is replaced), or None where the modules run it."""
    if (dtype not in native.KERNEL_DTYPES or moe.expert_parallel is not None or moe.swiglu_limit is not None
            or moe.gate.route_kernels is None):  # (the kernel has no clamp)
        return None
    return view.get((dtype,), lambda: build_moe_block(moe, dtype))


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
