"""An MoE whose output, routed plus shared experts, goes through an RMSNorm before the residual (A.X K1)."""
from __future__ import annotations

import torch

from latentserve.layers.moe import MoE, RoutingConfig
from latentserve.layers.norm import RMSNorm


class NormedMoE(MoE):
    def __init__(self, hidden_size: int, moe_intermediate_size: int, routing: RoutingConfig, n_shared_experts: int,
                 eps: float) -> None:
        super().__init__(hidden_size, moe_intermediate_size, routing, n_shared_experts)
        self.post_mlp_layernorm = RMSNorm(hidden_size, eps=eps)  # transformers' name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_mlp_layernorm(super().forward(x))
