"""Llama 4's position-dependent query scaling (Mistral 4 on YaRN): past each multiple of the original context, a
token's query grows by a factor 1 + beta * log(1 + floor(position / original)), sharpening attention at long range."""
from __future__ import annotations

import torch
from torch import nn


class Llama4QueryScaling(nn.Module):
    def __init__(self, beta: float, original_max_position_embeddings: int) -> None:
        super().__init__()
        self.beta = beta
        self.original = original_max_position_embeddings

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """positions `[T]` -> fp32 multipliers `[T]`, computed as transformers does."""
        return 1 + self.beta * torch.log(1 + torch.floor(positions / self.original))


class LogPositionQueryScaling(nn.Module):
    """Mistral Large 4's learned query scaling: head h's query at position p times scale[h] * log(p + 1) + bias[h],
    one pair of learned numbers per head and layer (checkpoint: `self_attn.softmax_scaling.{scale,bias}`)."""

    def __init__(self, num_heads: int) -> None:
        super().__init__()
        # (no effect until loaded: 0 * log + 1)
        self.scale = nn.Parameter(torch.zeros(num_heads))
        self.bias = nn.Parameter(torch.ones(num_heads))

    def forward(self, log_pos: torch.Tensor) -> torch.Tensor:
        """`log_positions` `[T]` -> multipliers `[T, num_heads]` in the parameters' dtype, as transformers computes
        them."""
        return self.scale * log_pos.to(self.scale.dtype)[:, None] + self.bias


def log_positions(positions: torch.Tensor) -> torch.Tensor:
    """positions `[T]` -> log(position + 1) `[T]`, in fp32 so that large positions keep their precision: computed
    once per forward, each layer's `LogPositionQueryScaling` turns it into its heads' multipliers."""
    return (positions + 1).float().log()
