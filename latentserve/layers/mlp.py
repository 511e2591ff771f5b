"""The SwiGLU feed-forward block used by dense layers, routed experts and shared experts."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from latentserve import batch_invariant
from latentserve.layers.linear import Linear
from latentserve.layers.quant.experts import tokens_mlp


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up may run as one fused layer (`fuse_gate_up`)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.gate_up_proj: nn.Module | None = None

    def fuse_gate_up(self, gate_up_proj: nn.Module) -> None:
        """Replace gate and up by one layer whose outputs are gate's then up's: one kernel call instead of two."""
        if gate_up_proj.out_features != 2 * self.down_proj.in_features:
            raise ValueError(f"a fused gate_up layer needs {2 * self.down_proj.in_features} outputs, "
                             f"got {gate_up_proj.out_features}")
        del self.gate_proj, self.up_proj
        self.gate_up_proj = gate_up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        # Batch-1 decode: one kernel call; in batch-invariant mode every token as it would be alone.
        if (x.shape[0] == 1 or batch_invariant.is_enabled()) and (y := tokens_mlp(self, x)) is not None:
            return y
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
