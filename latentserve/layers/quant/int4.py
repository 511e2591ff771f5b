"""int4 weights, asymmetric per group of `group_size` input columns: w ≈ q * scale + minimum, q in [0, 15]."""
from __future__ import annotations

import torch
from torch import nn

from latentserve.layers.linear import linear
from latentserve.layers.quant.int8 import BLOCK_ELEMENTS


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 `[out, in]` in [0, 15], scale fp32 `[out, in/g]`, minimum fp32 `[out, in/g]`):
    q = round((w - minimum) / scale) per group, scale = (max - minimum) / 15."""
    out_features, in_features = weight.shape
    groups = in_features // group_size
    q = torch.empty(out_features, in_features, dtype=torch.uint8, device=weight.device)
    scale = torch.empty(out_features, groups, dtype=torch.float32, device=weight.device)
    minimum = torch.empty_like(scale)
    rows = max(1, BLOCK_ELEMENTS // in_features)  # blockwise, as quantize_int8 (same values as all at once)
    for start in range(0, out_features, rows):
        w = weight[start:start + rows].to(torch.float32, copy=True).view(-1, groups, group_size)
        lo, s = minimum[start:start + rows], scale[start:start + rows]
        # amax and amin apart: one aminmax over short groups measured 8x slower than both together.
        torch.amin(w, dim=-1, out=lo)
        torch.div(torch.amax(w, dim=-1).sub_(lo).clamp_(min=1e-12), 15, out=s)
        q[start:start + rows] = w.sub_(lo[..., None]).div_(s[..., None]).round_().clamp_(0, 15).view(-1, in_features)
    return q, scale, minimum


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """fp32 `[out, in]` from `quantize_int4`'s output."""
    groups = scale.shape[1]
    w = q.view(q.shape[0], groups, -1).float() * scale[..., None] + minimum[..., None]
    return w.view(q.shape)


class Int4Linear(nn.Module):
    """The portable kernel: two weights per byte, dequantized to the activations' dtype at each call."""

    kernel = "int4 dequantize + matmul"

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.register_buffer("qweight", q[:, 0::2] | (q[:, 1::2] << 4))
        self.register_buffer("scale", scale)
        self.register_buffer("minimum", minimum)
        self.bias = bias

    def dequantized(self) -> torch.Tensor:
        q = torch.stack([self.qweight & 15, self.qweight >> 4], dim=-1).view(self.out_features, self.in_features)
        return dequantize_int4(q, self.scale, self.minimum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.dequantized().to(x.dtype), self.bias)


class Int4PackLinear(nn.Module):
    """PyTorch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`): packed nibbles, per-group scale and zero in the
    activations' dtype (`compute_dtype`: bf16 is its fast path, on AVX2 too; fp32 is exact but far slower)."""

    kernel = "int4pack_mm"

    def __init__(
        self, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bias: nn.Parameter | None,
        compute_dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.group_size = q.shape[1] // scale.shape[1]
        self.compute_dtype = compute_dtype
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1))
        # The kernel computes (q - 8) * scale + zero.
        zero = minimum + 8 * scale
        self.register_buffer("scales_and_zeros", torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
                             .to(compute_dtype))
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(self.compute_dtype), self.packed, self.group_size, self.scales_and_zeros
        ).to(x.dtype)
        return y if self.bias is None else y.add_(self.bias)
