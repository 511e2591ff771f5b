"""LongCat-Flash's MoE: the router also picks among `zero_expert_num` zero-compute experts, identities whose output is
the token itself times their routing weight. Routed experts only (no shared ones)."""
from __future__ import annotations

import torch

from latentserve.forward_context import dbo_yield
from latentserve.layers.moe import MoE, RoutingConfig


class ZeroExpertMoE(MoE):
    def __init__(self, hidden_size: int, moe_intermediate_size: int, routing: RoutingConfig,
                 zero_expert_num: int) -> None:
        super().__init__(hidden_size, moe_intermediate_size, routing, n_shared_experts=0)
        self.num_real = routing.n_routed_experts - zero_expert_num
        del self.experts[self.num_real:]  # the router scores all; only these compute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        identity = ids >= self.num_real
        identity_weight = weights.masked_fill(~identity, 0.0).sum(dim=-1, keepdim=True)
        # An identity's slot goes to expert 0 at weight 0, which adds exactly nothing.
        ids, weights = ids.masked_fill(identity, 0), weights.masked_fill(identity, 0.0)
        if self.expert_parallel is not None:
            routed = self.expert_parallel(x, weights, ids)
        else:
            dbo_yield()  # where expert parallelism's dispatch all-to-all goes
            routed = self.run_experts(x, weights, ids)
            dbo_yield()  # where its combine all-to-all goes
        return routed + (x * identity_weight).to(routed.dtype)
