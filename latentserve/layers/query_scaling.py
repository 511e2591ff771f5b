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
