"""llama.cpp's Q6_K weights (a GGUF's, `Q6KWeight`) as the file holds them: w = d * sc * (q - 32), an fp16 d per 256
input columns, an int8 sub-scale sc per 16, q in [0, 63]: 6.5625 bits a weight (6.625 in the kernel's layout), where
int8 per row reads 8 and rounds the values again."""
from __future__ import annotations

import torch
from torch import nn

from latentserve.kernels import native


class NativeQ6KLinear(nn.Module):
    """latentserve's Q6_K kernel (`kernels/native/`, `native.pack_q6k`'s layout) at every row count. fp32 and bf16
    activations go in as they are; out in `out_dtype` (None: the activations' dtype)."""

    kernel = "latentserve q6_k"

    def __init__(self, q: torch.Tensor, d: torch.Tensor, sc: torch.Tensor, bias: nn.Parameter | None,
                 kernels: native.NativeKernels, out_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.kernels, self.out_dtype = kernels, out_dtype
        self.register_buffer("packed", native.pack_q6k(q, d, sc))
        self.bias = bias

    def native_weight(self, dtype: torch.dtype, kernels: native.NativeKernels) -> tuple[native.Weight, None] | None:
        """(this layer as a one-call block reads it, None: it runs latentserve's kernel at any row count) where it
        runs `kernels` on `dtype` activations, out in the same dtype, without a bias; else None."""
        if self.kernels != kernels or self.bias is not None or self.out_dtype not in (None, dtype):
            return None
        return native.Weight(kind=native.Q6K, w=self.packed.data_ptr(), group=16), None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = native.activations(x, self.in_features)
        dtype = self.out_dtype or x.dtype
        y = native.q6k_linear(self.kernels, x2, self.packed, self.out_features, dtype)
        y = y.view(*x.shape[:-1], self.out_features).to(dtype)
        return y if self.bias is None else y.add_(self.bias)
