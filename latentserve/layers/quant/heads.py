"""MLA's absorbed decode products with int8 weights, under int8 and int4 (llama.cpp quantizes kv_b too)."""
from __future__ import annotations

import torch

from latentserve.kernels import native
from latentserve.layers.quant.int8 import NATIVE_INT8_ROWS, quantize_int8


class Int8HeadProducts:
    """y[t, h] = x[t, h] @ w[h]^T with w `[H, N, K]` in int8 per output row, activations quantized per (t, h): one
    kernel call for all heads. Up to NATIVE_INT8_ROWS tokens: callers keep the full-precision weight for more."""

    max_tokens = NATIVE_INT8_ROWS

    def __init__(self, w: torch.Tensor, kernels: native.NativeKernels) -> None:
        heads, n, k = w.shape
        q, scale = quantize_int8(w.reshape(heads * n, k))
        self.kernels = kernels
        self.q, self.scale = q.view(heads, n, k), scale
        self.qsum = q.sum(dim=1, dtype=torch.int32)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x `[T, H, K]` -> `[T, H, N]` in x's dtype."""
        xa = native.activations(x, x.shape[-1]).view(x.shape)
        return native.int8_heads(self.kernels, xa, self.q, self.scale, self.qsum, x.dtype).to(x.dtype)
