"""int8 weights, symmetric per output channel: w ≈ q * scale[out]."""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from latentserve.layers.linear import linear
from latentserve.kernels import native


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


@contextmanager
def _packing_for_fbgemm() -> Iterator[None]:
    """Pack for fbgemm itself, whatever torch's default quantized engine ("x86" picks per op; one run measured its
    packing 1.9x slower at 1 row, others equal: benchmarks/RESULTS.md). Quantized tensors are deprecated as a user
    API, but fbgemm's packing takes one."""
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = "fbgemm"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        torch.backends.quantized.engine = previous


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


class FbgemmInt8Linear(nn.Module):
    """Dynamic int8 through fbgemm: each call quantizes the activations per tensor (uint8) and runs an int8 GEMM
    on the prepacked weight (`torch.ops.quantized.linear_dynamic`), fp32 out."""

    kernel = "fbgemm int8 linear_dynamic"
    activation_dtype = torch.float32  # what the kernel takes and returns

    def __init__(
        self, q: torch.Tensor, scale: torch.Tensor, bias: nn.Parameter | None, reduce_range: bool,
        out_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.out_dtype = out_dtype  # None: the activations' dtype
        # Without VNNI fbgemm's u8*s8 pair sums saturate int16: 7-bit activations avoid that.
        self.reduce_range = reduce_range
        zero_points = torch.zeros(q.shape[0], dtype=torch.long)
        with _packing_for_fbgemm():
            qweight = torch._make_per_channel_quantized_tensor(q, scale.double(), zero_points, 0)
            self.packed = torch.ops.quantized.linear_prepack(qweight, None)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.quantized.linear_dynamic(x.float(), self.packed, self.reduce_range).to(self.out_dtype or x.dtype)
        return y if self.bias is None else y.add_(self.bias)


class NativeInt8Linear(nn.Module):
    """latentserve's int8 kernel (`kernels/native/`) at every row count, the weight in blocks of 16 outputs
    (`native.pack_int8`), activations quantized per row (symmetric, 8 bits): one 64-byte load feeds 16 outputs and
    every row of a pass, so at many rows the activations are read once per block, not once per output (2x faster
    than the one-row-at-a-time kernel at 512 rows and above oneDNN's `_int_mm`: benchmarks/RESULTS.md). fp32 and
    bf16 activations go in as they are; out in `out_dtype` (None: the activations' dtype)."""

    kernel = "latentserve int8"

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: nn.Parameter | None, kernels: native.NativeKernels,
                 out_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.kernels, self.out_dtype = kernels, out_dtype
        self.register_buffer("packed", native.pack_int8(q, scale))
        self.bias = bias

    def native_weight(self, dtype: torch.dtype, kernels: native.NativeKernels) -> tuple[native.Weight, None] | None:
        """(this layer as a one-call block reads it, None: it runs latentserve's kernel at any row count) where it
        runs `kernels` on `dtype` activations, out in the same dtype, without a bias; else None."""
        if self.kernels != kernels or self.bias is not None or self.out_dtype not in (None, dtype):
            return None
        return native.Weight(kind=native.INT8_BLOCKS, w=self.packed.data_ptr()), None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = native.activations(x, self.in_features)
        dtype = self.out_dtype or x.dtype
        y = native.int8_linear(self.kernels, x2, self.packed, self.out_features, dtype)
        y = y.view(*x.shape[:-1], self.out_features).to(dtype)
        return y if self.bias is None else y.add_(self.bias)
