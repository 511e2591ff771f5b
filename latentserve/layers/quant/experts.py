"""Routed experts that cannot be stacked (quantized, or with a bias): one kernel call per expert that got tokens."""
from __future__ import annotations

import torch
from torch import nn

from latentserve import batch_invariant
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
    if x.shape[0] == 1 or batch_invariant.is_enabled():
        return _each_token(experts, x, xa, weights, ids)
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


def _each_token(experts: nn.ModuleList, x: torch.Tensor, xa: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor) -> torch.Tensor:
    """Batch-1 decode, or every token in batch-invariant mode: each token's top-k experts straight from its ids,
    without the sort, gathers and scatters; with latentserve's kernels, all of them in one call, each token's result
    as it would be alone."""
    ids_sorted, order = ids.sort(dim=-1)
    chosen = [[experts[e] for e in row] for row in ids_sorted.tolist()]
    native_out = _native_tokens(chosen, xa, weights.gather(1, order))
    if native_out is not None:
        return native_out.view_as(x).to(x.dtype)
    if x.shape[0] > 1:
        raise RuntimeError("batch-invariant mode runs quantized experts on latentserve's kernels, which do not take "
                           f"these ({type(experts[0]).__name__})")
    out = torch.zeros_like(x)
    for expert, weight in zip(chosen[0], weights[0][order[0]]):
        out.add_((expert(xa) * weight).to(x.dtype))
    return out


def tokens_mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """A gated MLP (dense or shared experts) over the tokens x `[T, K]` in native calls, each token's result as it
    would be alone, or None where its layers are not latentserve's kernels."""
    out = _native_tokens([[mlp]] * x.shape[0], x, torch.ones(x.shape[0], 1))
    return None if out is None else out.view_as(x).to(x.dtype)


# Tokens per `experts_tokens` call: each thread keeps 64 bytes per (token, expert) pair on its stack.
TOKENS_PER_CALL = 64


def packed_format(layer: nn.Module) -> native.Format | None:
    """A layer's weight format as the native experts read it ((8, 0): `pack_int8`; (4, G): `pack_int4`), or None
    where it is not one of latentserve's bias-free quantized layers."""
    if getattr(layer, "bias", None) is not None:
        return None
    if type(layer) is NativeInt8Linear:
        return 8, 0
    if type(layer) is NativeInt4Linear:
        return 4, layer.group_size
    return None


def _native_tokens(chosen: list[list[nn.Module]], xa: torch.Tensor, gates: torch.Tensor) -> torch.Tensor | None:
    """Token t through its experts `chosen[t]` (one count for all) with `native.experts_tokens` where each is a fused
    gate_up and a down of latentserve's kernels, bias-free, every gate_up in one format and every down in one
    (the two may differ); None otherwise."""
    if any(getattr(e, "swiglu_limit", None) is not None for row in chosen for e in row):
        return None  # the kernel has no clamp
    layers = [[(getattr(e, "gate_up_proj", None), e.down_proj) for e in row] for row in chosen]
    flat = [pair for row in layers for pair in row]
    formats = {(packed_format(gu), packed_format(d)) for gu, d in flat}
    if len(formats) != 1 or None in next(iter(formats)):
        return None
    gate_up = flat[0][0]
    x = native.activations(xa, xa.shape[-1])
    gates = gates.float().contiguous()
    outs = [native.experts_tokens(gate_up.kernels, x[t : t + TOKENS_PER_CALL].contiguous(),
                                  _pointers(layers[t : t + TOKENS_PER_CALL]), gates[t : t + TOKENS_PER_CALL],
                                  gate_up.out_features // 2, next(iter(formats)))
            for t in range(0, len(chosen), TOKENS_PER_CALL)]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _pointers(layers: list[list[tuple[nn.Module, nn.Module]]]) -> list[torch.Tensor]:
    """The weights `experts_tokens` reads per (token, expert), in its order."""
    return [layer.packed for row in layers for pair in row for layer in pair]
