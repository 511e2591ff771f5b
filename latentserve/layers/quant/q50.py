"""llama.cpp's Q5_0 weights (a GGUF's, `Q50Weight`) as the file holds them: w = d * (q - 16), an fp16 d per 32 input
columns, q in [0, 31]: 5.5 bits a weight, in the kernel's layout too, where int8 per row reads 8 and rounds the
values again. Q4_K_M files keep a tensor at Q5_0 where its rows are not a multiple of 256 (DeepSeek-V2's experts'
down projections: 1408 columns)."""
from __future__ import annotations

import torch
from torch import nn

from latentserve.kernels import native
from latentserve.layers.quant.packed import NativePackedLinear
from latentserve.layers.quant.prequantized import Q50Weight


class NativeQ50Linear(NativePackedLinear):
    """latentserve's Q5_0 kernel (`kernels/native/`, `native.pack_q50`'s layout) at every row count."""

    kernel = "latentserve q5_0"
    weight_kind, group = native.Q50, 32
    file_type, columns, read = "Q5_0", 64, "5.5 bits a weight read; int8 per row reads 8"

    def __init__(self, q: torch.Tensor, d: torch.Tensor, bias: nn.Parameter | None, kernels: native.NativeKernels,
                 out_dtype: torch.dtype | None = None) -> None:
        super().__init__(native.pack_q50(q, d), q.shape[1], q.shape[0], bias, kernels, out_dtype)

    @classmethod
    def of(cls, weight: Q50Weight, bias: nn.Parameter | None, kernels: native.NativeKernels,
           out_dtype: torch.dtype | None) -> NativeQ50Linear:
        return cls(weight.q, weight.d, bias, kernels, out_dtype)

    def product(self, x2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return native.q50_linear(self.kernels, x2, self.packed, self.out_features, dtype)
