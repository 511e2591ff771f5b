"""A decode step's DeepSeek MoE block, from the router to the residual, in one native call (kernels/moe_block.c)
where every piece would run latentserve's kernels anyway: the router's fp32 product, the native routing, and either
the stacked fp32/bf16 experts (up to 3 tokens, as far as the modules' router takes the same kernel; their shared
experts folded in or none) or quantized int8/int4 experts and shared MLP (up to 8 tokens). The kernel chains those
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
from latentserve.layers.quant.int4 import NativeInt4Linear
from latentserve.layers.quant.int8 import NativeInt8Linear
from latentserve.models.native_view import NativeView

Built = tuple[native.MoEBlock, int, object]  # the kernel's view, up to how many tokens, what its pointers point into


def _quantized_layers(mlp: nn.Module, kernels: native.NativeKernels) -> tuple[nn.Module, nn.Module] | None:
    """(gate_up, down) of a gated MLP whose two layers are one of latentserve's quantized kinds, bias-free."""
    layers = (getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None))
    kind = type(layers[0])
    if kind not in (NativeInt8Linear, NativeInt4Linear) or any(
            type(layer) is not kind or layer.bias is not None or layer.kernels.isa != kernels.isa for layer in layers):
        return None
    return layers


def _pointers(layers: tuple[nn.Module, nn.Module]) -> list[torch.Tensor]:
    """An expert's tensors in the order `experts_tokens` takes their addresses."""
    if type(layers[0]) is NativeInt8Linear:
        return [t for layer in layers for t in (layer.qweight, layer.scale, layer.qsum)]
    return [layer.packed for layer in layers]


def _groups(layers: tuple[nn.Module, nn.Module]) -> tuple[int, int]:
    return getattr(layers[0], "group_size", 0), getattr(layers[1], "group_size", 0)


def _quantized(moe: MoE, block: native.MoEBlock, kernels: native.NativeKernels) -> tuple[int, object, list] | None:
    """Fills in the quantized experts: (tokens it runs, its pointer tables, their tensors), or None."""
    experts = [_quantized_layers(e, kernels) for e in moe.experts]
    shared = [] if moe.shared_experts is None else [_quantized_layers(moe.shared_experts, kernels)]
    every = [layers for layers in experts + shared if layers is not None]
    if len(every) != len(experts) + len(shared) or len({type(layers[0]) for layers in every}) != 1:
        return None  # one quantized kind throughout
    if len({_groups(layers) for layers in experts}) != 1:
        return None  # the routed experts in one call: one pair of group sizes
    block.bits = 8 if type(every[0][0]) is NativeInt8Linear else 4
    block.int4_groups[:] = _groups(experts[0])
    block.inter = experts[0][0].out_features // 2
    if any(layers[0].out_features != 2 * block.inter for layers in experts):
        return None
    tensors = [t for layers in experts for t in _pointers(layers)]
    table = (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))
    block.table, tables = ctypes.addressof(table), [table]
    if shared:
        shared_tensors = _pointers(shared[0])
        tables.append((ctypes.c_void_p * len(shared_tensors))(*(t.data_ptr() for t in shared_tensors)))
        block.shared, block.shared_inter = ctypes.addressof(tables[-1]), shared[0][0].out_features // 2
        block.shared_int4_groups[:] = _groups(shared[0])
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
