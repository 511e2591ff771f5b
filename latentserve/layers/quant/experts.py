"""Routed experts that cannot be stacked (quantized, or with a bias): one kernel call per expert that got tokens."""
from __future__ import annotations

import torch
from torch import nn


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
    """Batch-1 decode: the token's top-k experts straight from its ids, without the sort, gathers and scatters."""
    out = torch.zeros_like(x)
    for expert, weight in sorted(zip(ids[0].tolist(), weights[0])):
        out.add_((experts[expert](xa) * weight).to(x.dtype))
    return out
