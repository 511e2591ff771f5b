"""`Linear`: nn.Linear whose skinny CPU products run as (W @ xᵀ)ᵀ, the orientation MKL spreads over threads."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Rows for which the transposed product wins on CPU with several threads (benchmarks/vs_transformers.py,
# "linear orientation"): x @ Wᵀ with a few rows keeps MKL's threads idle, W @ xᵀ splits the weight's rows
# over them. With one thread neither orientation wins.
SKINNY_ROWS = range(2, 33)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x `[T, in]`; contiguous `[T, out]`."""
    if x.device.type != "cpu" or x.dim() != 2 or x.shape[0] not in SKINNY_ROWS or torch.get_num_threads() == 1:
        return F.linear(x, weight, bias)
    out = torch.mm(weight, x.t()).t().contiguous()
    return out if bias is None else out.add_(bias)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
