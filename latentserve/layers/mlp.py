"""The SwiGLU feed-forward block used by dense layers, routed experts and shared experts."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from latentserve import batch_invariant
from latentserve.layers.linear import Linear
from latentserve.layers.quant.experts import tokens_mlp


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up may run as one fused layer (`fuse_gate_up`). With `swiglu_limit`
    (Hunyuan V4's routed experts) gate is clamped to at most the limit and up to within it, before the product."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 swiglu_limit: float | None = None) -> None:
        super().__init__()
        self.swiglu_limit = swiglu_limit
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
            return self.down_proj(self._act(self.gate_proj(x), self.up_proj(x)))
        # Batch-1 decode: one kernel call; in batch-invariant mode every token as it would be alone.
        if (x.shape[0] == 1 or batch_invariant.is_enabled()) and (y := tokens_mlp(self, x)) is not None:
            return y
        return self.down_proj(self._act(*self.gate_up_proj(x).chunk(2, dim=-1)))

    def _act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        limit = self.swiglu_limit
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return F.silu(gate) * up
