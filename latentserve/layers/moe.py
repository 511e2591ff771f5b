"""DeepSeek mixture-of-experts: top-k routing (V2 softmax, V3 sigmoid + bias), routed and shared experts."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from latentserve import batch_invariant
from latentserve.forward_context import dbo_yield
from latentserve.kernels import native
from latentserve.kernels.policy import KernelPolicy, default_policy
from latentserve.layers.linear import linear
from latentserve.layers.mlp import GatedMLP
from latentserve.layers.quant.experts import NativeExperts, run_expert_loop
from latentserve.layers.stacked_experts import NATIVE_MAX_TOKENS, StackedExperts

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

    def native_router(self, dtype: torch.dtype) -> tuple[native.MoEBlock, int, list[torch.Tensor]] | None:
        """(this router and its routing as moe_block.c reads them, in a block of `dtype` activations whose experts
        are still to fill in; up to how many rows its product runs latentserve's kernel, past which `linear` takes
        MKL's sums; the tensors read by address), or None where they do not run latentserve's kernels."""
        kernels, cfg, bias = self.route_kernels, self.cfg, self.e_score_correction_bias
        if kernels is None or self.weight.dtype != torch.float32 or not self.weight.is_contiguous():
            return None
        block = native.MoEBlock(
            hidden=self.weight.shape[1], experts=cfg.n_routed_experts, topk=cfg.num_experts_per_tok,
            groups=cfg.num_groups, topk_groups=cfg.kept_groups, sigmoid=int(cfg.scoring_func == "sigmoid"),
            norm=int(cfg.norm_topk_prob), scaling=cfg.routed_scaling_factor, router=self.weight.data_ptr(),
            bias=None if bias is None else bias.data_ptr(), bf=int(dtype == torch.bfloat16))
        return block, self.native_rows, [self.weight] + ([] if bias is None else [bias])

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
        self.native_experts = NativeExperts()  # quantized experts (and shared MLP): `native.experts` calls

    def stack_experts(self, device: torch.device | str | None = None) -> None:
        """Run the local routed experts stacked (`StackedExperts`, on `device`; None: their weights' device). Their
        parameters become views of the stack, so a checkpoint loaded afterwards fills it in place. Quantized
        experts, whose kernels take one weight each, keep the per-expert loop. Plain shared experts join the stack's
        few-token kernel calls (their gate and up then views of one fused weight, as the routed ones are)."""
        self.stacked = StackedExperts.stack(self.experts, device, self.shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        if self.expert_parallel is not None:
            routed = self.expert_parallel(x, weights, ids)
            return routed if self.shared_experts is None else routed + self.shared_experts(x)
        dbo_yield()  # where expert parallelism's dispatch all-to-all goes
        out = (self.stacked.with_shared(x, weights, ids) if self.stacked is not None
               else self.native_experts(self.experts, self.shared_experts, x, weights, ids))
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
        """Experts that cannot be stacked (quantized, or biased): `native.experts` calls where they are its kinds,
        else one batched call per expert that got tokens."""
        out = self.native_experts(self.experts, None, x, weights, ids)
        return run_expert_loop(self.experts, x, weights, ids) if out is None else out
