"""Routed experts that cannot be stacked (quantized, or with a bias): one kernel call per expert that got tokens."""
from __future__ import annotations

import torch
from torch import nn

from latentserve.kernels import native
from latentserve.layers.quant.int4 import NativeInt4Linear
from latentserve.layers.quant.int8 import NativeInt8Linear


def activation_dtype(expert: nn.Module, default: torch.dtype) -> torch.dtype:
    """The dtype `expert`'s first layer computes in (fbgemm: fp32; int4pack: its compute dtype; else `default`):
    feeding it that dtype saves a conversion per layer, and the expert's intermediate stays in it."""
    first = getattr(expert, "gate_up_proj", None) or getattr(expert, "gate_proj", None)
    return getattr(first, "activation_dtype", None) or default


def run_expert_loop(experts: nn.ModuleList, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """sum_k weights[t, k] * experts[ids[t, k]](x[t]); contributions add up in (expert, token) order, as under
    expert parallelism."""
    if x.shape[0] == 0:
        return torch.zeros_like(x)  # an expert-parallel rank may receive no tokens
    xa = x.to(activation_dtype(experts[int(ids[0, 0])], x.dtype))
    if x.shape[0] == 1:
        return _one_token(experts, x, xa, weights, ids)
    out = torch.zeros_like(x)
    top_k = ids.shape[1]
    flat_ids = ids.flatten()
    order = torch.argsort(flat_ids, stable=True)
    tokens = order // top_k
    pair_weights = weights.flatten().index_select(0, order)[:, None]
    counts = torch.bincount(flat_ids, minlength=len(experts)).tolist()
    # Gather and scatter per expert: no buffer of all T*k rows, whose fresh pages cost more than the math at
    # prefill sizes.
    start = 0
    for expert, count in zip(experts, counts):
        if count:
            rows = tokens[start : start + count]
            y = expert(xa.index_select(0, rows)) * pair_weights[start : start + count]
            out.index_add_(0, rows, y.to(x.dtype))
            start += count
    return out


def _one_token(experts: nn.ModuleList, x: torch.Tensor, xa: torch.Tensor, weights: torch.Tensor,
               ids: torch.Tensor) -> torch.Tensor:
    """Batch-1 decode: the token's top-k experts straight from its ids, without the sort, gathers and scatters; with
    latentserve's kernels, all of them in one call."""
    ids_sorted, order = ids[0].sort()
    chosen = ids_sorted.tolist()
    native_out = _native_one_token([experts[e] for e in chosen], xa, weights[0][order])
    if native_out is not None:
        return native_out.view_as(x).to(x.dtype)
    out = torch.zeros_like(x)
    for expert, weight in zip(chosen, weights[0][order]):
        out.add_((experts[expert](xa) * weight).to(x.dtype))
    return out


def one_token_mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """A gated MLP (dense or shared experts) over one token in one native call, or None where its layers are not
    latentserve's kernels."""
    if x.numel() != x.shape[-1]:
        return None
    out = _native_one_token([mlp], x, _ONE)
    return None if out is None else out.view_as(x).to(x.dtype)


_ONE = torch.ones(1)


def _native_one_token(chosen: list[nn.Module], xa: torch.Tensor, gates: torch.Tensor) -> torch.Tensor | None:
    """The chosen experts through `native.experts_tokens` where each is a fused gate_up and a down of latentserve's
    kernels, bias-free; None otherwise."""
    if any(getattr(e, "swiglu_limit", None) is not None for e in chosen):
        return None  # the kernel has no clamp
    layers = [(getattr(e, "gate_up_proj", None), e.down_proj) for e in chosen]
    kind = type(layers[0][0])
    if kind not in (NativeInt8Linear, NativeInt4Linear) or any(
        type(gu) is not kind or type(d) is not kind or gu.bias is not None or d.bias is not None for gu, d in layers
    ):
        return None
    if kind is NativeInt8Linear:
        weights = [t for gu, d in layers for t in (gu.qweight, gu.scale, gu.qsum, d.qweight, d.scale, d.qsum)]
        bits, groups = 8, (0, 0)
    else:
        weights = [t for gu, d in layers for t in (gu.packed, d.packed)]
        bits, groups = 4, (layers[0][0].group_size, layers[0][1].group_size)
        if any((gu.group_size, d.group_size) != groups for gu, d in layers):
            return None
    gate_up = layers[0][0]
    return native.experts_tokens(gate_up.kernels, native.activations(xa, xa.shape[-1]), weights,
                                 gates.float().reshape(1, -1).contiguous(), gate_up.out_features // 2, bits, groups)
