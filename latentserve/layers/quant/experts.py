"""Routed experts that cannot be stacked (quantized, or with a bias): one kernel call per expert that got tokens."""
from __future__ import annotations

import torch
from torch import nn

from latentserve import batch_invariant
from latentserve.kernels import native


def activation_dtype(expert: nn.Module, default: torch.dtype) -> torch.dtype:
    """The dtype `expert`'s first layer computes in (int4pack: its compute dtype; else `default`):
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
    chosen = sorted(set(ids.flatten().tolist()))  # table order = id order: the kernel sums a token's experts by it
    position = {e: i for i, e in enumerate(chosen)}
    local = torch.tensor([[position[e] for e in row] for row in ids.tolist()], dtype=torch.int64)
    native_out = _native_tokens([experts[e] for e in chosen], local, xa, weights)
    if native_out is not None:
        return native_out.view_as(x).to(x.dtype)
    if x.shape[0] > 1:
        raise RuntimeError("batch-invariant mode runs quantized experts on latentserve's kernels, which do not take "
                           f"these ({type(experts[0]).__name__})")
    ids_sorted, order = ids.sort(dim=-1)
    out = torch.zeros_like(x)
    for e, weight in zip(ids_sorted[0].tolist(), weights[0][order[0]]):
        out.add_((experts[e](xa) * weight).to(x.dtype))
    return out


def mlp_table(mlp: nn.Module) -> native.Experts | None:
    """A gated MLP as a one-expert table of the experts kernel, or None where its layers are not latentserve's
    kernels. Kept on the module, keyed by the weights' addresses (rebuilt when one is replaced; the kept table holds
    the old weights, so an address is never reused under it): building it checks and describes both weights, 14 us a
    layer and step with the Python in cache (V3's shared-MLP shape), several times that after a decode step's weights
    have streamed through the caches."""
    layers = expert_layers(mlp)
    if layers is None:
        return None
    key = tuple(layer.packed.data_ptr() for layer in layers)
    kept = getattr(mlp, "_tokens_table", None)
    if kept is None or kept[0] != key:
        kept = mlp._tokens_table = (key, quantized_table([mlp]))
    return kept[1]


def tokens_mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """A gated MLP (dense or shared experts) over the tokens x `[T, K]` in native calls, each token's result as it
    would be alone, or None where its layers are not latentserve's kernels."""
    table = mlp_table(mlp)
    if table is None:
        return None
    tokens = x.shape[0]
    out = _in_calls(mlp.gate_up_proj.kernels, native.activations(x, x.shape[-1]), table,
                    torch.zeros(tokens, 1, dtype=torch.int64), torch.ones(tokens, 1), None)
    return out.view_as(x).to(x.dtype)


# Tokens per `native.experts` call: its sums (8 bytes a token and hidden column) and gathered activations (top-k
# rows a token) grow with them, its waves' buffers do not; each call reads every chosen expert once.
TOKENS_PER_CALL = 2048


def packed_format(layer: nn.Module) -> native.Format | None:
    """A layer's weight format as the native experts read it (its `expert_format`: latentserve's int8, int4 and GGUF
    block layers have one), or None where it is not one of them or has a bias."""
    if getattr(layer, "bias", None) is not None:
        return None
    return getattr(layer, "expert_format", None)


def expert_layers(mlp: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    """(gate_up, down) of a gated MLP whose two layers are latentserve's quantized kinds, bias-free and unclamped
    (the kernel has no clamp), else None."""
    layers = (getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None))
    if getattr(mlp, "swiglu_limit", None) is not None or any(packed_format(layer) is None for layer in layers):
        return None
    return layers


def quantized_table(experts: list[nn.Module]) -> native.Experts | None:
    """`experts` as the experts kernel reads them, or None where one is not `expert_layers`' kind or they differ in
    format or width (one table: one format per projection, one intermediate size)."""
    layers = [expert_layers(e) for e in experts]
    if any(pair is None for pair in layers):
        return None
    formats = {(packed_format(gate_up), packed_format(down), gate_up.out_features, down.out_features)
               for gate_up, down in layers}
    if len(formats) != 1:
        return None
    gate_up, down = layers[0]
    return native.expert_table([(g.packed, d.packed) for g, d in layers], down.out_features,
                               gate_up.out_features // 2, (packed_format(gate_up), packed_format(down)))


def _native_tokens(experts: list[nn.Module], ids: torch.Tensor, xa: torch.Tensor,
                   gates: torch.Tensor) -> torch.Tensor | None:
    """Token t through experts[ids[t, j]] weighted gates[t, j] with `native.experts` where they are one
    `quantized_table`; None otherwise."""
    table = quantized_table(experts)
    if table is None:
        return None
    return _in_calls(experts[0].gate_up_proj.kernels, native.activations(xa, xa.shape[-1]), table, ids, gates, None)


def _in_calls(kernels: native.NativeKernels, x: torch.Tensor, table: native.Experts, ids: torch.Tensor,
              gates: torch.Tensor, shared: native.Experts | None) -> torch.Tensor:
    """`native.experts` over x's tokens, TOKENS_PER_CALL a call."""
    gates = gates.float().contiguous()
    outs = [native.experts(kernels, x[t : t + TOKENS_PER_CALL].contiguous(), table, ids[t : t + TOKENS_PER_CALL],
                           gates[t : t + TOKENS_PER_CALL], shared)
            for t in range(0, x.shape[0], TOKENS_PER_CALL)]
    return outs[0] if len(outs) == 1 else torch.cat(outs)


class NativeExperts:
    """A MoE's routed experts and shared MLP in `native.experts` calls at any token count, where they are
    `quantized_table`s on one build: prefill's MoE in one parallel region (each chosen expert read once for all its
    tokens, routed and shared together) instead of a few dozen torch ops and two kernel calls per expert. Each token's
    result is what it is alone, as in decode's one-call MoE block (`models/moe_block.py`): the routed experts summed
    in fp32 in id order, rounded once, plus the shared output rounded (the loop rounded after each expert's add).
    The tables are kept, keyed by the weights' addresses (a replaced weight rebuilds them; the kept tables hold the
    old weights, so an address is never reused under them)."""

    def __init__(self) -> None:
        self._tables: dict[bool, tuple[tuple[int, ...], native.Experts | None]] = {}

    def __call__(self, experts: nn.ModuleList, shared: nn.Module | None, x: torch.Tensor, weights: torch.Tensor,
                 ids: torch.Tensor) -> torch.Tensor | None:
        """sum_k weights[t, k] * experts[ids[t, k]](x[t]) (+ shared(x[t]) where `shared`), or None where these
        experts or tokens do not run here."""
        if x.device.type != "cpu" or x.dtype not in native.KERNEL_DTYPES or x.shape[0] == 0:
            return None
        routed = self._table(False, list(experts))
        held = None if shared is None else self._table(True, [shared])
        if routed is None or (shared is not None and held is None):
            return None
        kernels = experts[0].gate_up_proj.kernels
        if held is not None and shared.gate_up_proj.kernels is not kernels:
            return None
        return _in_calls(kernels, x, routed, ids, weights, held)

    def _table(self, is_shared: bool, mlps: list[nn.Module]) -> native.Experts | None:
        layers = [expert_layers(m) for m in mlps]
        if any(pair is None for pair in layers):
            return None
        kernels = layers[0][0].kernels
        if any(layer.kernels is not kernels for pair in layers for layer in pair):
            return None
        key = tuple(layer.packed.data_ptr() for pair in layers for layer in pair)
        kept = self._tables.get(is_shared)
        if kept is None or kept[0] != key:
            kept = self._tables[is_shared] = (key, quantized_table(mlps))
        return kept[1]
