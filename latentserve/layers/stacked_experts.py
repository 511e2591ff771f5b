"""Routed experts stacked into two weights (`StackedExperts`): grouped GEMMs for many tokens, latentserve's kernel
for a few, expert by expert for a couple of (token, expert) pairs."""
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
# Up to this many tokens run their stacked fp32/bf16 experts through latentserve's kernel, in one call (each token
# reads its experts' weights on its own). Measured against the batched paths with
# weights streamed, 2 threads (benchmarks/RESULTS.md): even at 1-4 tokens, 1.04-1.63x at 6-8 on both the 94M V3's
# experts (16, top-4) and V2-Lite's (64, top-6) in fp32 and bf16; from 12 (bf16) or 16 (fp32) tokens the batched
# paths win, reading each expert once.
NATIVE_MAX_TOKENS = 8

def _is_plain(expert: nn.Module) -> bool:
    return isinstance(expert, GatedMLP) and expert.gate_up_proj is None and expert.swiglu_limit is None and all(
        type(p) is Linear and p.bias is None for p in (expert.gate_proj, expert.up_proj, expert.down_proj)
    )


class StackedExperts(nn.Module):
    """Routed experts `first`.. as two stacked weights, gate and up fused: every expert runs in two
    `torch._grouped_mm` calls, whatever the number of experts (no Python loop over them). Up to `NATIVE_MAX_TOKENS`
    tokens run through latentserve's kernel instead, with the shared experts (`shared`) where they are plain; its
    kernels asked once (`process_weights_after_loading`; built outside a loader: `default_policy()` at the first
    call)."""

    kernels: native.NativeKernels | None = None
    native_rows: tuple[int, int] | None = None  # `linear`'s rows over (w13, w2t) expert by expert; None: not asked

    def __init__(self, first: int, w13: torch.Tensor, w2t: torch.Tensor, shared: GatedMLP | None = None) -> None:
        super().__init__()
        self.first = first
        # Not persistent: the state dict keeps the checkpoint's per-expert names (views of these).
        self.register_buffer("w13", w13, persistent=False)  # [E, 2I, H]: gate rows, then up rows
        # [E, I, H]: down projections stored transposed. A product of a few rows with [H, I] reads rows of I
        # (short: 384-2048) at about half the memory bandwidth of one with [I, H] (2x faster at batch 1).
        self.register_buffer("w2t", w2t, persistent=False)
        # The shared experts (S = a multiple of the routed experts' I, down projection stored transposed), run as S / I
        # more experts of gate 1 after the routed ones. In a tuple: the MoE owns the module, not the stack.
        self.shared = (shared,) if shared is not None else None

    @property
    def w2(self) -> torch.Tensor:
        """The down projections as the checkpoint has them, [E, H, I] (a view)."""
        return self.w2t.transpose(1, 2)

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
        w2t = torch.empty(len(local), inter, hidden, dtype=like.dtype, device=device)
        for k, (_, e) in enumerate(local):
            _place(e.gate_proj, w13[k, :inter])
            _place(e.up_proj, w13[k, inter:])
            _place(e.down_proj, w2t[k].t())
        fold = (shared is not None and _is_plain(shared) and shared.down_proj.weight.dtype == like.dtype
                and shared.down_proj.in_features % inter == 0)
        if fold:
            d = shared.down_proj.weight
            _place(shared.down_proj, torch.empty(d.shape[1], d.shape[0], dtype=d.dtype, device=device).t())
        return cls(local[0][0], w13, w2t, shared if fold else None)

    def process_weights_after_loading(self, policy: KernelPolicy) -> None:
        self.kernels = policy.kernels
        hidden, inter = self.w13.shape[2], self.w2t.shape[1]
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
        if self.shared is None or not stacked_layout(self.shared[0]):
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
            y = torch._grouped_mm(F.silu(gate) * up, self.w2t, offs=offs)
        y = y * weights.flatten().index_select(0, order)[:, None]
        # Contributions add up in (expert, token) order, as in the loop and under expert parallelism.
        return torch.zeros_like(x).index_add_(0, tokens, y if y.dtype == x.dtype else y.to(x.dtype))

    def _native(self, kernels: native.NativeKernels, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                with_shared: bool) -> torch.Tensor:
        """Every token's experts (in expert order, then the shared ones) in one kernel call, for decode and the few
        tokens of a speculative verification: each token's result is the same however the batch around it is
        split. Each token reads its experts' weights on its own (the batched paths read each expert once)."""
        shared = None
        if with_shared:
            mlp = self.shared[0]
            shared = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight.t())
        return native.stacked_experts(kernels, x.contiguous(), self.w13, self.w2t, self.first, ids,
                                      weights.float(), shared)

    def native_stack(self, block: native.MoEBlock, dtype: torch.dtype, kernels: native.NativeKernels,
                     with_shared: bool) -> list[torch.Tensor] | None:
        """Fills in `block`'s experts (moe_block.c) with this stack, the folded shared experts too where
        `with_shared`: the tensors it reads by address, or None where the kernel `kernels` on `dtype` activations
        does not run them (the stack's own choice: `_native`)."""
        if self.kernels != kernels or self.first or self.w13.dtype != dtype:
            return None
        block.inter, block.w13, block.w2t = self.w2t.shape[1], self.w13.data_ptr(), self.w2t.data_ptr()
        tensors = [self.w13, self.w2t]
        if with_shared:
            if self.shared is None or not stacked_layout(self.shared[0]):
                return None
            mlp = self.shared[0]
            shared = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight.t())
            block.shared_chunks = shared[0].shape[0] // block.inter
            block.sg, block.su, block.sd = (t.data_ptr() for t in shared)
            tensors += shared
        return tensors

    def _per_expert(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The sorted rows through their experts with `linear`, one expert with tokens at a time."""
        out = rows.new_empty(rows.shape[0], self.w2.shape[1])
        start = 0
        for expert, count in enumerate(counts):
            if count:
                gate, up = linear(rows[start : start + count], self.w13[expert], None, self.kernels,
                                  self.native_rows[0]).chunk(2, dim=-1)
                out[start : start + count] = linear(F.silu(gate) * up, self.w2t[expert].t(), None, self.kernels,
                                                    self.native_rows[1])
                start += count
        return out


def stacked_layout(mlp: GatedMLP) -> bool:
    """Whether the shared experts' weights are still laid out as the stack reads them (gate and up contiguous, down
    transposed): replacing a parameter afterwards must not make the kernel read the wrong rows."""
    gate, up, down = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
    return gate.is_contiguous() and up.is_contiguous() and down.t().is_contiguous()


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
