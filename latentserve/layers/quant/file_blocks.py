"""The linear layers on a GGUF's weights kept as the file's blocks (`FileBlocks`: Q6_K, Q3_K, Q2_K, Q5_0, Q5_1, Q5_K,
Q4_K): each format's layer (q6k.py, q45.py) names its packing and its kernel; this is the rest."""
from __future__ import annotations

from dataclasses import fields
from typing import Callable

import torch
from torch import nn

from latentserve.kernels import native
from latentserve.layers.quant.packed import NativePackedLinear
from latentserve.layers.quant.prequantized import FileBlocks


class NativeFileBlocksLinear(NativePackedLinear):
    """A GGUF weight kept as its file's blocks (`FileBlocks`), packed by `pack` from the weight's fields in their order
    and run by `linear` at every row count. `file_type`, `columns` (the multiple of inputs the kernel takes) and `read`
    are what `blocks_kernel` says of it."""

    pack: Callable[..., torch.Tensor]
    linear: Callable[..., torch.Tensor]
    file_type: str
    columns: int
    read: str

    @classmethod
    def of(cls, weight: FileBlocks, bias: nn.Parameter | None, kernels: native.NativeKernels,
           out_dtype: torch.dtype | None) -> NativeFileBlocksLinear:
        packed = cls.pack(*(getattr(weight, f.name) for f in fields(weight)))
        return cls(packed, weight.shape[1], weight.shape[0], bias, kernels, out_dtype)

    def product(self, x2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return type(self).linear(self.kernels, x2, self.packed, self.out_features, dtype)
