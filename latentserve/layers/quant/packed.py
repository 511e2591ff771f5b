"""What the linear layers on latentserve's packed weights share (int8's and the GGUF formats' blocks of 16 outputs): the
descriptor a one-call block reads, and the forward around the kernel's call."""
from __future__ import annotations

import torch
from torch import nn

from latentserve.kernels import native


class NativePackedLinear(nn.Module):
    """A linear layer whose weight is `packed` in one of the kernels' layouts, run by `product` (the subclass's kernel)
    at every row count; fp32 and bf16 activations go in as they are, out in `out_dtype` (None: the activations'
    dtype). `weight_kind` and `group`: what a one-call block reads (`native.Weight`); `expert_format`: what the native
    experts read (`native.expert_table`)."""

    weight_kind: int
    group = 0
    expert_format: native.Format

    def __init__(self, packed: torch.Tensor, in_features: int, out_features: int, bias: nn.Parameter | None,
                 kernels: native.NativeKernels, out_dtype: torch.dtype | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.kernels, self.out_dtype = kernels, out_dtype
        self.register_buffer("packed", packed)
        self.bias = bias

    def product(self, x2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def native_weight(self, dtype: torch.dtype, kernels: native.NativeKernels) -> tuple[native.Weight, None] | None:
        """(this layer as a one-call block reads it, None: it runs latentserve's kernel at any row count) where it
        runs `kernels` on `dtype` activations, out in the same dtype, without a bias; else None."""
        if self.kernels != kernels or self.bias is not None or self.out_dtype not in (None, dtype):
            return None
        return native.Weight(kind=self.weight_kind, w=self.packed.data_ptr(), group=self.group), None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.out_dtype or x.dtype
        y = self.product(native.activations(x, self.in_features), dtype)
        y = y.view(*x.shape[:-1], self.out_features).to(dtype)
        return y if self.bias is None else y.add_(self.bias)
