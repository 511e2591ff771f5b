"""int8 weights, symmetric per output channel: w ≈ q * scale[out]."""
from __future__ import annotations

import functools

import torch
from torch import nn

from latentserve.layers.linear import linear
from latentserve.kernels import native
from latentserve.layers.quant.packed import NativePackedLinear


# Elements converted at a time: a block's fp32 temporary (512 KB) stays in L2 through the element-wise passes, which
# over a whole weight each streamed it through memory (measured 3-4x slower on V2-Lite's expert matrices).
BLOCK_ELEMENTS = 1 << 17


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 `[out, in]` in [-127, 127], scale fp32 `[out]`): q = round(w / scale), scale = max|w[out]| / 127."""
    out_features, in_features = weight.shape
    q = torch.empty(out_features, in_features, dtype=torch.int8, device=weight.device)
    scale = torch.empty(out_features, dtype=torch.float32, device=weight.device)
    rows = max(1, BLOCK_ELEMENTS // in_features)
    for start in range(0, out_features, rows):
        block = weight[start:start + rows].to(torch.float32, copy=True)
        s = scale[start:start + rows]
        torch.div(block.abs().amax(dim=1).clamp_(min=1e-12), 127, out=s)
        q[start:start + rows] = block.div_(s[:, None]).round_().clamp_(-127, 127)
    return q, scale


class Int8Linear(nn.Module):
    """The portable kernel: the weight is dequantized to the activations' dtype at each call."""

    kernel = "int8 dequantize + matmul"

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.qweight.to(x.dtype) * self.scale[:, None].to(x.dtype)
        return linear(x, w, self.bias)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq int8 `[M, K]`, scale fp32 `[M, 1]`) for x `[M, K]`, as latentserve's kernels quantize an int8 layer's
    activations (`kernels/quant_acts.c`): per row, symmetric, scale = max(max |x|, 1e-12) / 127, xq = x / scale
    rounded half to even. A row holding a NaN or an infinity gets scale NaN and xq 0, so its outputs are NaN."""
    x = x.float()
    scale = x.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12).div_(127)
    scale.masked_fill_(~scale.isfinite(), float("nan"))
    return x.div(scale).round_().nan_to_num_(0.0).to(torch.int8), scale


@functools.cache
def int_mm_parts() -> int:
    """How many `torch._int_mm` products sum int8 x int8 exactly here: 1 where it sums exactly (oneDNN with VNNI);
    2 where it saturates (oneDNN without VNNI shifts the activations to u8 and adds u8 x s8 pairs in int16:
    127 * 127 summed over 64 columns came out 8160, not 1032256, under `ONEDNN_MAX_CPU_ISA=AVX2`). Then the weight
    goes in as its high and low parts, q = 16 * (q >> 4) + (q & 15): pair sums of at most 2 * 255 * 15."""
    rows = torch.tensor([[127] * 64, [-127] * 64, [127, -127] * 32], dtype=torch.int8)
    exact = rows.long() @ rows.long().t()
    return 1 if torch.equal(torch._int_mm(rows, rows.t()).long(), exact) else 2


class IntMMInt8Linear(nn.Module):
    """latentserve's int8 arithmetic through PyTorch, where its kernels do not run (no compiler, no AVX2,
    `LATENTSERVE_NATIVE_KERNELS=0`, inputs not a multiple of 4): activations quantized per row (`quantize_rows`),
    exact int32 sums by `torch._int_mm` (in `int_mm_parts` products), then sum * x's scale * the weight's in fp32.
    The same bits as `NativeInt8Linear` at every row count, so each row's result is its own."""

    kernel = "int8 per-row torch._int_mm"

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: nn.Parameter | None,
                 out_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.out_dtype = out_dtype  # None: the activations' dtype
        self.register_buffer("qweight", q[None] if int_mm_parts() == 1 else torch.stack([q >> 4, q & 15]))
        self.register_buffer("scale", scale)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq, xs = quantize_rows(native.activations(x, self.in_features))
        y = torch._int_mm(xq, self.qweight[0].t())
        if len(self.qweight) == 2:
            y = y.mul_(16).add_(torch._int_mm(xq, self.qweight[1].t()))
        y = y.float().mul_(xs).mul_(self.scale)
        y = y.view(*x.shape[:-1], self.out_features).to(self.out_dtype or x.dtype)
        return y if self.bias is None else y.add_(self.bias)


class NativeInt8Linear(NativePackedLinear):
    """latentserve's int8 kernel (`kernels/native/`) at every row count, the weight in blocks of 16 outputs
    (`native.pack_int8`), activations quantized per row (symmetric, 8 bits): one 64-byte load feeds 16 outputs and
    every row of a pass, so at many rows the activations are read once per block, not once per output (2x faster
    than the one-row-at-a-time kernel at 512 rows and above oneDNN's `_int_mm`: benchmarks/RESULTS.md)."""

    kernel = "latentserve int8"
    weight_kind, expert_format = native.INT8_BLOCKS, (8, 0)

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: nn.Parameter | None, kernels: native.NativeKernels,
                 out_dtype: torch.dtype | None = None) -> None:
        super().__init__(native.pack_int8(q, scale), q.shape[1], q.shape[0], bias, kernels, out_dtype)

    def product(self, x2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return native.int8_linear(self.kernels, x2, self.packed, self.out_features, dtype)
