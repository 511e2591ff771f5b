"""LongCat-Flash's decoder layer: two attention + dense MLP sublayers, and a shortcut MoE that reads the first
sublayer's MLP input and adds its output to the second's residual. Each attention sublayer may run as the one-call
decode block (its input norm, attention, residual, post norm, exactly that block's shape); the MoE, whose output
does not go to its own residual, runs its modules."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from latentserve.kernels.policy import KernelPolicy
from latentserve.layers.mlp import GatedMLP
from latentserve.layers.moe import MoE
from latentserve.layers.norm import RMSNorm
from latentserve.layers.zero_expert_moe import ZeroExpertMoE
from latentserve.models.attention_block import fused_attention, native_block

if TYPE_CHECKING:
    from latentserve.models.config import ModelConfig
    from latentserve.models.deepseek import DeepseekAttention


class ShortcutMoEDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attentions: list[DeepseekAttention]) -> None:
        super().__init__()
        c = config
        self.self_attn = nn.ModuleList(attentions)
        self.mlps = nn.ModuleList(GatedMLP(c.hidden_size, c.intermediate_size) for _ in attentions)
        self.input_layernorm = nn.ModuleList(RMSNorm(c.hidden_size, eps=c.rms_norm_eps) for _ in attentions)
        self.post_attention_layernorm = nn.ModuleList(RMSNorm(c.hidden_size, eps=c.rms_norm_eps) for _ in attentions)
        self.mlp = (ZeroExpertMoE(c.hidden_size, c.moe_intermediate_size, c.routing, c.zero_expert_num)
                    if c.zero_expert_num else MoE(c.hidden_size, c.moe_intermediate_size, c.routing, 0))

    def process_weights_after_loading(self, policy: KernelPolicy) -> None:
        """Builds each attention sublayer's one-call decode block once, chaining what its modules chose from `policy`
        (the loader processes them first); a weight replaced later rebuilds it."""
        if policy.kernels is None:
            return
        for j, attn in enumerate(self.self_attn):
            norms = (self.input_layernorm[j], self.post_attention_layernorm[j])
            native_block(attn, norms, norms[0].weight.dtype)

    def _attention(self, j: int, cos: torch.Tensor, sin: torch.Tensor, hidden: torch.Tensor,
                   q_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, post_norm(h)) with h = hidden + attention j over its input norm."""
        norms = (self.input_layernorm[j], self.post_attention_layernorm[j])
        fused = fused_attention(self.self_attn[j], norms, cos, sin, hidden) if q_scale is None else None
        if fused is not None:
            return fused
        hidden = hidden + self.self_attn[j](cos, sin, norms[0](hidden), q_scale)
        return hidden, norms[1](hidden)

    def forward(self, cos: torch.Tensor, sin: torch.Tensor, hidden: torch.Tensor,
                q_scale: torch.Tensor | None = None) -> torch.Tensor:
        hidden, normed = self._attention(0, cos, sin, hidden, q_scale)
        shortcut = self.mlp(normed)
        hidden = hidden + self.mlps[0](normed)
        hidden, normed = self._attention(1, cos, sin, hidden, q_scale)
        return hidden + self.mlps[1](normed) + shortcut
