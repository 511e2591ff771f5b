"""Routed experts stacked into two weights (`StackedExperts`): grouped GEMMs for many tokens, latentserve's experts
kernel for a few, expert by expert for a couple of (token, expert) pairs."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from latentserve import batch_invariant
from latentserve.kernels import native
from latentserve.kernels.policy import KernelPolicy, default_policy
from latentserve.layers.linear import Linear, linear
from latentserve.layers.mlp import GatedMLP

# At most this many (token, expert) pairs run expert by expert on a multi-threaded CPU (`per_expert_wins`).
PER_EXPERT_MAX_PAIRS = 4
# Up to this many tokens run their stacked fp32/bf16 experts through latentserve's experts kernel, in one call (an
# expert several tokens chose read once for all of them). Measured with the kernel before it, which read each
# token's experts on its own, against the batched paths with weights streamed, 2 threads (benchmarks/RESULTS.md):
# even at 1-4 tokens, 1.04-1.63x at 6-8 on both the 94M V3's experts (16, top-4) and V2-Lite's (64, top-6) in fp32
# and bf16; from 12 (bf16) or 16 (fp32) tokens the batched paths win.
NATIVE_MAX_TOKENS = 8

def _is_plain(expert: nn.Module) -> bool:
    return isinstance(expert, GatedMLP) and expert.gate_up_proj is None and expert.swiglu_limit is None and all(
        type(p) is Linear and p.bias is None for p in (expert.gate_proj, expert.up_proj, expert.down_proj)
    )


class StackedExperts(nn.Module):
    """Routed experts `first`.. as two stacked weights, gate and up fused: every expert runs in two
    `torch._grouped_mm` calls, whatever the number of experts (no Python loop over them). Up to `NATIVE_MAX_TOKENS`
    tokens run through latentserve's experts kernel instead (`native.experts`), with the shared experts (`shared`)
    where they are plain; its kernels asked once (`process_weights_after_loading`; built outside a loader:
    `default_policy()` at the first call)."""

    kernels: native.NativeKernels | None = None
    native_rows: tuple[int, int] | None = None  # `linear`'s rows over (w13, w2) expert by expert; None: not asked
    _tables: tuple[tuple, native.Experts, native.Experts | None] | None = None  # (addresses, routed, shared)

    def __init__(self, first: int, w13: torch.Tensor, w2: torch.Tensor, shared: GatedMLP | None = None,
                 shared_gate_up: torch.Tensor | None = None) -> None:
        super().__init__()
        self.first = first
        # Not persistent: the state dict keeps the checkpoint's per-expert names (views of these).
        self.register_buffer("w13", w13, persistent=False)  # [E, 2I, H]: gate rows, then up rows
        self.register_buffer("w2", w2, persistent=False)  # [E, H, I], as the checkpoint has them
        # The shared experts (any width S), their gate and up views of one [2S, H] weight (`shared_gate_up`), run
        # as one more expert of gate 1. In a tuple: the MoE owns the module, not the stack.
        self.shared = (shared,) if shared is not None else None
        self.register_buffer("shared_gate_up", shared_gate_up, persistent=False)

    @classmethod
    def stack(cls, experts: nn.ModuleList, device: torch.device | str | None = None,
              shared: nn.Module | None = None) -> StackedExperts | None:
        """The stack of the local experts (a contiguous range: expert parallelism owns one), or None where one is
        quantized or has a bias. Weights already there (not on meta) are copied in, one expert at a time."""
        local = [(i, e) for i, e in enumerate(experts) if isinstance(e, GatedMLP)]
        if not local or not all(_is_plain(e) for _, e in local) or local[-1][0] - local[0][0] + 1 != len(local):
            return None
        like = local[0][1].down_proj.weight
        hidden, inter = like.shape
        device = like.device if device is None else device
        w13 = torch.empty(len(local), 2 * inter, hidden, dtype=like.dtype, device=device)
        w2 = torch.empty(len(local), hidden, inter, dtype=like.dtype, device=device)
        for k, (_, e) in enumerate(local):
            _place(e.gate_proj, w13[k, :inter])
            _place(e.up_proj, w13[k, inter:])
            _place(e.down_proj, w2[k])
        if shared is None or not _is_plain(shared) or shared.down_proj.weight.dtype != like.dtype:
            return cls(local[0][0], w13, w2)
        width = shared.down_proj.in_features
        gate_up = torch.empty(2 * width, hidden, dtype=like.dtype, device=device)
        _place(shared.gate_proj, gate_up[:width])
        _place(shared.up_proj, gate_up[width:])
        return cls(local[0][0], w13, w2, shared, gate_up)

    def process_weights_after_loading(self, policy: KernelPolicy) -> None:
        self.kernels = policy.kernels
        hidden, inter = self.w13.shape[2], self.w2.shape[2]
        self.native_rows = (policy.dense_rows(self.w13.dtype, hidden), policy.dense_rows(self.w13.dtype, inter))

    def _kernels(self, x: torch.Tensor) -> native.NativeKernels | None:
        """latentserve's kernels where they run these tokens, else None."""
        if self.native_rows is None:
            self.process_weights_after_loading(default_policy())
        on_cpu = x.device.type == "cpu" and x.dtype == self.w13.dtype in native.KERNEL_DTYPES
        few = x.shape[0] <= NATIVE_MAX_TOKENS or batch_invariant.is_enabled()
        return self.kernels if on_cpu and 0 < x.shape[0] and few else None

    def with_shared(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
        """Routed plus shared experts' output in one kernel call, or None where the stack cannot take them."""
        if not self._shared_in_place():
            return None
        kernels = self._kernels(x)
        return None if kernels is None else self._native(kernels, x, weights, ids, with_shared=True)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        kernels = self._kernels(x)
        if kernels is not None:
            return self._native(kernels, x, weights, ids, with_shared=False)
        top_k = ids.shape[1]
        flat_ids = ids.flatten() - self.first if self.first else ids.flatten()
        order = torch.argsort(flat_ids, stable=True)
        tokens = order // top_k
        counts = torch.bincount(flat_ids, minlength=len(self.w13))
        rows = x.index_select(0, tokens)
        if per_expert_wins(x, len(flat_ids)):
            y = self._per_expert(rows, counts.tolist())
        else:
            # Group g of the sorted rows ends at offs[g]; experts without tokens are empty groups.
            offs = counts.cumsum(0, dtype=torch.int32)
            gate, up = torch._grouped_mm(rows, self.w13.transpose(1, 2), offs=offs).chunk(2, dim=-1)
            y = torch._grouped_mm(F.silu(gate) * up, self.w2.transpose(1, 2), offs=offs)
        y = y * weights.flatten().index_select(0, order)[:, None]
        # Contributions add up in (expert, token) order, as in the loop and under expert parallelism.
        return torch.zeros_like(x).index_add_(0, tokens, y if y.dtype == x.dtype else y.to(x.dtype))

    def _native(self, kernels: native.NativeKernels, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                with_shared: bool) -> torch.Tensor:
        """Every token's experts (in expert order, then the shared ones) in one kernel call, for decode and the few
        tokens of a speculative verification: each token's result is the same however the batch around it is
        split."""
        routed, shared = self.tables()
        return native.experts(kernels, x.contiguous(), routed, ids - self.first if self.first else ids,
                              weights.float(), shared if with_shared else None)

    def tables(self) -> tuple[native.Experts, native.Experts | None]:
        """The stack (and the shared experts where they are in place) as the experts kernel reads them; rebuilt
        where a weight was replaced."""
        shared = self.shared[0] if self._shared_in_place() else None
        tensors = (self.w13, self.w2) + ((self.shared_gate_up, shared.down_proj.weight) if shared else ())
        addresses = tuple(t.data_ptr() for t in tensors)
        if self._tables is None or self._tables[0] != addresses:
            fmt = native.DENSE_FORMATS[self.w13.dtype]
            hidden, inter = self.w2.shape[1:]
            routed = native.expert_table(list(zip(self.w13, self.w2)), hidden, inter, (fmt, fmt))
            held = None if shared is None else native.expert_table(
                [(self.shared_gate_up, shared.down_proj.weight)], hidden, shared.down_proj.in_features, (fmt, fmt))
            self._tables = (addresses, routed, held)
        return self._tables[1], self._tables[2]

    def _shared_in_place(self) -> bool:
        """Whether the shared experts' gate and up are still the views of `shared_gate_up` the kernel reads and their
        down projection a contiguous weight of this stack's dtype: replacing a parameter afterwards must not make the
        kernel read the wrong rows."""
        if self.shared is None:
            return False
        mlp, width = self.shared[0], self.shared_gate_up.shape[0] // 2
        gate, up, down = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
        return (gate.data_ptr() == self.shared_gate_up.data_ptr() and up.data_ptr() == self.shared_gate_up[width:]
                .data_ptr() and gate.shape == up.shape == self.shared_gate_up[width:].shape and down.is_contiguous()
                and down.dtype == self.w13.dtype)

    def native_stack(self, block: native.MoEBlock, dtype: torch.dtype, kernels: native.NativeKernels,
                     with_shared: bool) -> list | None:
        """Fills in `block`'s experts (moe_block.c) with this stack, the shared experts too where `with_shared`:
        what the block reads by address, or None where the kernel `kernels` on `dtype` activations does not run them
        (the stack's own choice: `_native`)."""
        if self.kernels != kernels or self.first or self.w13.dtype != dtype:
            return None
        if with_shared and not self._shared_in_place():
            return None
        routed, shared = self.tables()
        block.routed = routed.table
        held = [routed]
        if with_shared:
            block.shared = shared.table
            held.append(shared)
        return held

    def _per_expert(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The sorted rows through their experts with `linear`, one expert with tokens at a time."""
        out = rows.new_empty(rows.shape[0], self.w2.shape[1])
        start = 0
        for expert, count in enumerate(counts):
            if count:
                gate, up = linear(rows[start : start + count], self.w13[expert], None, self.kernels,
                                  self.native_rows[0]).chunk(2, dim=-1)
                out[start : start + count] = linear(F.silu(gate) * up, self.w2[expert], None, self.kernels,
                                                    self.native_rows[1])
                start += count
        return out


def _place(layer: Linear, view: torch.Tensor) -> None:
    """Make `layer`'s weight the `view` (of a stack), copying in the values it already holds (not on meta)."""
    if not layer.weight.is_meta:
        with torch.no_grad():
            view.copy_(layer.weight)
    layer.weight = nn.Parameter(view, requires_grad=layer.weight.requires_grad)


def per_expert_wins(x: torch.Tensor, num_pairs: int) -> bool:
    """Whether a few (token, expert) pairs run faster expert by expert through `linear` than in `_grouped_mm`: on a
    CPU with several threads, at one token's top-4 (whole decode steps on a quiet machine: 10 % faster at 4 pairs,
    13-45 % slower at 8 and 32; benchmarks/RESULTS.md); on one thread the two are even, and the grouped call makes
    fewer dispatches."""
    return x.device.type == "cpu" and num_pairs <= PER_EXPERT_MAX_PAIRS and torch.get_num_threads() > 1
