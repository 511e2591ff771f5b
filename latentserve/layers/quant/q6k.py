"""llama.cpp's Q6_K weights (a GGUF's, `Q6KWeight`) as the file holds them: w = d * sc * (q - 32), an fp16 d per 256
input columns, an int8 sub-scale sc per 16, q in [0, 63]: 6.5625 bits a weight (6.625 in the kernel's layout), where
int8 per row reads 8 and rounds the values again."""
from __future__ import annotations

import torch
from torch import nn

from latentserve.kernels import native
from latentserve.layers.quant.packed import NativePackedLinear
from latentserve.layers.quant.prequantized import Q6K_D_COLUMNS, Q6KWeight


class NativeQ6KLinear(NativePackedLinear):
    """latentserve's Q6_K kernel (`kernels/native/`, `native.pack_q6k`'s layout) at every row count."""

    kernel = "latentserve q6_k"
    weight_kind, group = native.Q6K, 16
    file_type, columns, read = ("Q6_K", Q6K_D_COLUMNS,
                                "6.625 bits a weight read; int8 per row reads 8 and rounds the values again")

    def __init__(self, q: torch.Tensor, d: torch.Tensor, sc: torch.Tensor, bias: nn.Parameter | None,
                 kernels: native.NativeKernels, out_dtype: torch.dtype | None = None) -> None:
        super().__init__(native.pack_q6k(q, d, sc), q.shape[1], q.shape[0], bias, kernels, out_dtype)

    @classmethod
    def of(cls, weight: Q6KWeight, bias: nn.Parameter | None, kernels: native.NativeKernels,
           out_dtype: torch.dtype | None) -> NativeQ6KLinear:
        return cls(weight.q, weight.d, weight.sc, bias, kernels, out_dtype)

    def product(self, x2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return native.q6k_linear(self.kernels, x2, self.packed, self.out_features, dtype)
