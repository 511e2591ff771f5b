"""DeepSeek mixture-of-experts: top-k routing (V2 softmax, V3 sigmoid + bias), routed and shared experts."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from latentserve import batch_invariant
from latentserve.forward_context import dbo_yield
from latentserve.kernels import native
from latentserve.kernels.policy import KernelPolicy, default_policy
from latentserve.layers.linear import Linear, linear
from latentserve.layers.mlp import GatedMLP
from latentserve.layers.quant.experts import run_expert_loop

# At most this many (token, expert) pairs run expert by expert on a multi-threaded CPU (`per_expert_wins`).
PER_EXPERT_MAX_PAIRS = 4
# Up to this many tokens run their stacked fp32/bf16 experts through latentserve's kernel, in one call (each token
# reads its experts' weights on its own). Measured against the batched paths with
# weights streamed, 2 threads (benchmarks/RESULTS.md): even at 1-4 tokens, 1.04-1.63x at 6-8 on both the 94M V3's
# experts (16, top-4) and V2-Lite's (64, top-6) in fp32 and bf16; from 12 (bf16) or 16 (fp32) tokens the batched
# paths win, reading each expert once.
NATIVE_MAX_TOKENS = 8
# scoring function -> the top-k methods paired with it: DeepSeek's, Mistral 4's group_limited_top2 (softmax scores, a
# group scored by its best two experts as noaux_tc does) and LongCat-Flash's softmax noaux_tc (the correction bias
# steers the choice, over one group)
TOPK_METHODS = {"softmax": ("greedy", "group_limited_greedy", "group_limited_top2", "noaux_tc"),
                "sigmoid": ("noaux_tc",)}


@dataclass(frozen=True)
class RoutingConfig:
    """How a token picks its experts; field names follow DeepSeek's config.json."""

    n_routed_experts: int
    num_experts_per_tok: int
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int | None = None
    topk_group: int | None = None
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring_func not in TOPK_METHODS:
            raise ValueError(f"scoring_func must be one of {tuple(TOPK_METHODS)}, got {self.scoring_func!r}")
        if self.topk_method not in TOPK_METHODS[self.scoring_func]:
            raise ValueError(
                f"topk_method {self.topk_method!r} does not go with scoring_func {self.scoring_func!r}; "
                f"expected one of {TOPK_METHODS[self.scoring_func]}"
            )
        if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError(
                f"num_experts_per_tok must be in [1, n_routed_experts={self.n_routed_experts}], "
                f"got {self.num_experts_per_tok}"
            )
        if self.topk_method != "greedy":
            self._check_groups()
        if self.scoring_func == "softmax" and self.topk_method == "noaux_tc" and self.kept_groups != self.num_groups:
            raise ValueError("softmax noaux_tc routing takes every group: topk_group must equal n_group, got "
                             f"{self.topk_group} of {self.n_group}")

    @property
    def native_routing(self) -> bool:
        """Whether latentserve's routing kernel (route.c) computes this routing: under softmax it scores a group by its
        best expert and has no correction bias."""
        if self.scoring_func == "softmax" and self.topk_method == "noaux_tc":
            return False
        return self.topk_method != "group_limited_top2" or self.kept_groups == self.num_groups

    @property
    def num_groups(self) -> int:
        return self.n_group or 1

    @property
    def kept_groups(self) -> int:
        """Groups a token's experts may come from: topk_group where the method limits groups, else all of them."""
        return self.topk_group if self.topk_method != "greedy" else self.num_groups

    def _check_groups(self) -> None:
        n_group, topk_group = self.n_group, self.topk_group
        if not isinstance(n_group, int) or n_group <= 0 or self.n_routed_experts % n_group:
            raise ValueError(
                f"n_group must be a positive divisor of n_routed_experts={self.n_routed_experts} "
                f"for topk_method {self.topk_method!r}, got {n_group!r}"
            )
        if not isinstance(topk_group, int) or not 0 < topk_group <= n_group:
            raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group!r}")
        group_size = self.n_routed_experts // n_group
        if self.topk_method in ("noaux_tc", "group_limited_top2") and group_size < 2:
            raise ValueError(f"{self.topk_method} scores a group by its top 2 experts; n_group={n_group} leaves "
                             f"{group_size}")
        if self.num_experts_per_tok > topk_group * group_size:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} exceeds the {topk_group * group_size} experts "
                f"in topk_group={topk_group} groups of {group_size}"
            )


def _group_mask(group_scores: torch.Tensor, topk_group: int, group_size: int) -> torch.Tensor:
    """[T, E] bool: experts inside each token's `topk_group` best groups."""
    best = group_scores.topk(topk_group, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return keep.repeat_interleave(group_size, dim=1)


def select_experts(
    router_logits: torch.Tensor, cfg: RoutingConfig, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights [T, k] (fp32) and expert ids [T, k] from fp32 router logits [T, E]."""
    k = cfg.num_experts_per_tok
    num_tokens = router_logits.shape[0]
    group_size = cfg.n_routed_experts // cfg.num_groups
    limit_groups = cfg.kept_groups < cfg.num_groups  # else every group stays
    if cfg.scoring_func == "softmax":
        scores = router_logits.softmax(dim=-1)
        if limit_groups:
            grouped = scores.view(num_tokens, -1, group_size)
            group_scores = (grouped.topk(2, dim=-1).values.sum(dim=-1) if cfg.topk_method == "group_limited_top2"
                            else grouped.amax(dim=-1))
            # Softmax scores are positive, so a zero never outranks an expert of a kept group.
            scores = scores.masked_fill(~_group_mask(group_scores, cfg.topk_group, group_size), 0.0)
        if correction_bias is None:
            weights, ids = scores.topk(k, dim=-1)
        else:  # softmax noaux_tc, over one group
            ids = (scores + correction_bias).topk(k, dim=-1).indices
            weights = scores.gather(1, ids)
    else:
        scores = router_logits.sigmoid()
        # noaux_tc: the learned bias steers which experts are chosen, not how much they weigh.
        choice = scores if correction_bias is None else scores + correction_bias
        if limit_groups:
            group_scores = choice.view(num_tokens, -1, group_size).topk(2, dim=-1).values.sum(dim=-1)
            choice = choice.masked_fill(~_group_mask(group_scores, cfg.topk_group, group_size), float("-inf"))
        ids = choice.topk(k, dim=-1).indices
        weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    return weights, ids


class Router(nn.Module):
    """The gate: fp32 logits over routed experts, then `select_experts`; its kernels asked once
    (`process_weights_after_loading`; built outside a loader: `default_policy()` at the first call)."""

    kernels: native.NativeKernels | None = None
    native_rows: int | None = None  # the fp32 product's rows on `kernels` (`linear`); None: not asked yet

    def __init__(self, hidden_size: int, cfg: RoutingConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # fp32 whatever the model dtype, as the reference keeps it: near-ties decide routing.
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, hidden_size, dtype=torch.float32))
        if cfg.topk_method == "noaux_tc":
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def process_weights_after_loading(self, policy: KernelPolicy) -> None:
        self.kernels = policy.kernels
        self.native_rows = policy.dense_rows(torch.float32, self.weight.shape[1])

    @property
    def route_kernels(self) -> native.NativeKernels | None:
        """The kernels that route a few tokens (route.c), where they compute this routing."""
        return self.kernels if self.cfg.native_routing else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.native_rows is None:
            self.process_weights_after_loading(default_policy())
        # `linear`: latentserve's kernel at a few rows, whose sums round differently from MKL's only in the last bits.
        logits = linear(x if x.dtype == torch.float32 else x.float(), self.weight.float(), None, self.kernels,
                        self.native_rows)
        few = x.shape[0] <= NATIVE_MAX_TOKENS or batch_invariant.is_enabled()
        kernels = self.route_kernels if logits.device.type == "cpu" and few else None
        if kernels is None:
            return select_experts(logits, self.cfg, self.e_score_correction_bias)
        cfg = self.cfg  # a few decode tokens: one native call where select_experts takes a dozen small ops
        return native.route(kernels, logits, cfg.num_experts_per_tok, cfg.scoring_func == "sigmoid", cfg.num_groups,
                            cfg.kept_groups, self.e_score_correction_bias, cfg.norm_topk_prob,
                            cfg.routed_scaling_factor)


class MoE(nn.Module):
    """Shared experts plus the top-k routed experts, weighted by the router."""

    def __init__(
        self,
        hidden_size: int,
        moe_intermediate_size: int,
        routing: RoutingConfig,
        n_shared_experts: int,
        shared_bias: bool = False,
        swiglu_limit: float | None = None,
        shared_swiglu_limit: float | None = None,
        shared_intermediate_size: int | None = None,  # each shared expert's width; None: moe_intermediate_size
    ) -> None:
        super().__init__()
        self.gate = Router(hidden_size, routing)
        # Clamped experts (a `swiglu_limit`) are never stacked: the stack's kernels have no clamp.
        self.swiglu_limit = swiglu_limit
        self.experts = nn.ModuleList(
            GatedMLP(hidden_size, moe_intermediate_size, swiglu_limit=swiglu_limit)
            for _ in range(routing.n_routed_experts)
        )
        self.shared_experts = (
            GatedMLP(hidden_size, (shared_intermediate_size or moe_intermediate_size) * n_shared_experts,
                     bias=shared_bias, swiglu_limit=shared_swiglu_limit)
            if n_shared_experts
            else None
        )
        # Set by latentserve.distributed under expert parallelism: (x, weights, ids) -> routed output,
        # dispatching tokens to the ranks that own their experts and combining the results.
        self.expert_parallel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        # Set by stack_experts where the local experts' weights are plain tensors.
        self.stacked: StackedExperts | None = None

    def stack_experts(self, device: torch.device | str | None = None) -> None:
        """Run the local routed experts stacked (`StackedExperts`, on `device`; None: their weights' device). Their
        parameters become views of the stack, so a checkpoint loaded afterwards fills it in place. Quantized
        experts, whose kernels take one weight each, keep the per-expert loop. Plain shared experts join the stack's
        few-token kernel calls (their down projection is then stored transposed, as the routed ones are)."""
        self.stacked = StackedExperts.stack(self.experts, device, self.shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        if self.expert_parallel is not None:
            routed = self.expert_parallel(x, weights, ids)
            return routed if self.shared_experts is None else routed + self.shared_experts(x)
        dbo_yield()  # where expert parallelism's dispatch all-to-all goes
        out = self.stacked.with_shared(x, weights, ids) if self.stacked is not None else None
        if out is None:
            routed = self.run_experts(x, weights, ids)
            out = routed if self.shared_experts is None else routed + self.shared_experts(x)
        dbo_yield()  # where its combine all-to-all goes
        return out

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum_k weights[t, k] * expert[ids[t, k]](x[t])."""
        if self.stacked is not None:
            return self.stacked(x, weights, ids)
        return self._run_expert_loop(x, weights, ids)

    def _run_expert_loop(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """One batched call per expert that got tokens (experts that cannot be stacked: quantized, or biased)."""
        return run_expert_loop(self.experts, x, weights, ids)


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
