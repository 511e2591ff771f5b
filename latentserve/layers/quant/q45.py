"""llama.cpp's 4- and 5-bit weights as a GGUF holds them, for latentserve's kernels on their blocks: Q5_0
(`Q50Weight`, w = d * (q - 16), an fp16 d per 32 input columns: 5.5 bits a weight, in the kernel's layout too), Q5_K
and Q4_K (`Q5KWeight`, `Q4KWeight`: w = d * sc * q - dmin * m, per 256 columns an fp16 d and dmin, per 32 a 6-bit sc
and m: 5.5 and 4.5 bits, 5.75 and 4.75 in the kernel's layout). As int8 per row a weight reads 8 bits and its values
are rounded again; as int4's groups Q4_K read 5 bits, its scales rounded to bf16. Q4_K_M files are mostly Q4_K and
keep a tensor at Q5_0 where its rows are not a multiple of 256 (DeepSeek-V2's experts' down projections: 1408
columns); Q5_K_M files are mostly Q5_K."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from latentserve.kernels import native
from latentserve.layers.quant.packed import NativePackedLinear
from latentserve.layers.quant.prequantized import KQUANT_COLUMNS, Q4KWeight, Q5KWeight, Q50Weight


class NativeQ50Linear(NativePackedLinear):
    """latentserve's Q5_0 kernel (`kernels/native/`, `native.pack_q50`'s layout) at every row count."""

    kernel = "latentserve q5_0"
    weight_kind, group = native.Q50, 32
    file_type, columns, read = "Q5_0", 64, "5.5 bits a weight read; int8 per row reads 8 and rounds the values again"

    def __init__(self, q: torch.Tensor, d: torch.Tensor, bias: nn.Parameter | None, kernels: native.NativeKernels,
                 out_dtype: torch.dtype | None = None) -> None:
        super().__init__(native.pack_q50(q, d), q.shape[1], q.shape[0], bias, kernels, out_dtype)

    @classmethod
    def of(cls, weight: Q50Weight, bias: nn.Parameter | None, kernels: native.NativeKernels,
           out_dtype: torch.dtype | None) -> NativeQ50Linear:
        return cls(weight.q, weight.d, bias, kernels, out_dtype)

    def product(self, x2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return native.q50_linear(self.kernels, x2, self.packed, self.out_features, dtype)


class _NativeKQuantLinear(NativePackedLinear):
    """latentserve's kernel of a k-quant (`pack`'s layout, run by `linear`) at every row count."""

    group, columns = 256, KQUANT_COLUMNS
    pack: Callable[..., torch.Tensor]
    linear: Callable[..., torch.Tensor]

    def __init__(self, q: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, m: torch.Tensor,
                 bias: nn.Parameter | None, kernels: native.NativeKernels,
                 out_dtype: torch.dtype | None = None) -> None:
        super().__init__(type(self).pack(q, d, dmin, sc, m), q.shape[1], q.shape[0], bias, kernels, out_dtype)

    @classmethod
    def of(cls, weight: Q5KWeight | Q4KWeight, bias: nn.Parameter | None, kernels: native.NativeKernels,
           out_dtype: torch.dtype | None) -> _NativeKQuantLinear:
        return cls(weight.q, weight.d, weight.dmin, weight.sc, weight.m, bias, kernels, out_dtype)

    def product(self, x2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return type(self).linear(self.kernels, x2, self.packed, self.out_features, dtype)


class NativeQ5KLinear(_NativeKQuantLinear):
    """Q5_K (`native.pack_q5k`'s layout)."""

    kernel, weight_kind = "latentserve q5_k", native.Q5K
    file_type, read = "Q5_K", "5.75 bits a weight read; int8 per row reads 8 and rounds the values again"
    pack, linear = staticmethod(native.pack_q5k), staticmethod(native.q5k_linear)


class NativeQ4KLinear(_NativeKQuantLinear):
    """Q4_K (`native.pack_q4k`'s layout)."""

    kernel, weight_kind = "latentserve q4_k", native.Q4K
    file_type, read = "Q4_K", "4.75 bits a weight read, d * sc exactly; int4's groups read 5 and round it to bf16"
    pack, linear = staticmethod(native.pack_q4k), staticmethod(native.q4k_linear)
