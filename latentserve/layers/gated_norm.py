"""`GatedRMSNorm`: an RMSNorm whose output is scaled by a low-rank gate of itself (A.X K2's layer norms).

y = RMSNorm(x); out = y * sigmoid(W_up(silu(W_down(y)))). The gate's two projections are tiny (rank 16 in the published
models) and stay in the compute dtype, as norms and routers do: they are plain `nn.Linear`, which int8/int4 leave
alone."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from latentserve.layers.norm import RMSNorm


class GatedRMSNorm(nn.Module):
    """Parameter names follow the checkpoints: `norm.weight`, `W_down.weight`, `W_up.weight`."""

    def __init__(self, hidden_size: int, rank: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps=eps)
        self.W_down = nn.Linear(hidden_size, rank, bias=False)
        self.W_up = nn.Linear(rank, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return (y * torch.sigmoid(self.W_up(F.silu(self.W_down(y))).float())).to(y.dtype)
