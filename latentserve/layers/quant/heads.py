"""MLA's absorbed decode products with int8 weights, under int8 and int4 (llama.cpp quantizes kv_b too)."""
from __future__ import annotations

import torch

from latentserve.kernels import native
from latentserve.layers.quant.int8 import quantize_int8


# W_UK's [16, 512, 128] per-head product at one token: 1.7-1.85x faster in lanes (68 -> 38 us, weights streamed);
# W_UV's [16, 128, 512]: 1.22-1.35x (AVX2 1.07-1.25x) once the lanes sum in four chains (benchmarks/RESULTS.md).
LANES_COLUMNS = 512
HEAD_TOKENS = 24  # tokens the per-head products take in int8; callers keep the full-precision weight for more


class Int8HeadProducts:
    """y[t, h] = x[t, h] @ w[h]^T with w `[H, N, K]` in int8 per output row, activations quantized per (t, h): one
    kernel call for all heads. Up to HEAD_TOKENS tokens: callers keep the full-precision weight for more.
    Rows of at most LANES_COLUMNS (MLA's W_UK: 128, W_UV: 512), N % 16 == 0 and K % 4 == 0 keep `q` in
    `native.int8_lanes`' layout (`lanes`): the same outputs, read as one stream instead of one row at a time."""

    max_tokens = HEAD_TOKENS

    def __init__(self, w: torch.Tensor, kernels: native.NativeKernels) -> None:
        heads, n, k = w.shape
        q, scale = quantize_int8(w.reshape(heads * n, k))
        self.kernels = kernels
        self.lanes = n % 16 == 0 and k % 4 == 0 and k <= LANES_COLUMNS
        self.q = native.int8_lanes(q.view(heads, n, k)) if self.lanes else q.view(heads, n, k)
        self.scale = scale
        self.qsum = q.sum(dim=1, dtype=torch.int32)

    def native_weight(self) -> native.Weight:
        """The products as a one-call block reads them."""
        return native.Weight(kind=native.INT8_LANES if self.lanes else native.INT8, w=self.q.data_ptr(),
                             scale=self.scale.data_ptr(), qsum=self.qsum.data_ptr())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x `[T, H, K]` -> `[T, H, N]` in x's dtype."""
        xa = native.activations(x, x.shape[-1]).view(x.shape)
        product = native.int8_heads_lanes if self.lanes else native.int8_heads
        return product(self.kernels, xa, self.q, self.scale, self.qsum, x.dtype).to(x.dtype)
