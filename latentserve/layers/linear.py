"""`Linear`: nn.Linear whose skinny CPU products keep every thread streaming weights: latentserve's own kernel at
a few rows (as many as the `KernelPolicy` says, asked once per layer), layouts that make MKL and oneDNN do so
above."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from latentserve import batch_invariant
from latentserve.kernels import native
from latentserve.kernels.native import NativeKernels
from latentserve.kernels.policy import KernelPolicy, default_policy

# Layouts by row count with several threads (benchmarks/RESULTS.md, "Skinny products by dtype"). fp32: MKL runs a
# one-row product on one thread, and x @ Wᵀ keeps threads idle up to a few dozen rows; a bmm over row blocks of W
# (one per thread) wins at 1 and 4-8 rows, W @ xᵀ at the other counts up to 32. bf16/fp16 go through oneDNN,
# which keeps its threads busy: x @ Wᵀ is fastest up to 16 rows, W @ xᵀ from 17 to 32.
SPLIT_ROWS = (1, 4, 5, 6, 7, 8)
SKINNY_ROWS = {torch.float32: range(2, 33), torch.bfloat16: range(17, 33), torch.float16: range(17, 33)}


def _split_gemm(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """x `[T, in]` @ Wᵀ as one bmm over `parts` row blocks of W (views, nothing copied): each thread streams its
    own block."""
    blocks = weight.unflatten(0, (parts, -1)).transpose(1, 2)  # [parts, in, out/parts]
    out = torch.bmm(x.expand(parts, *x.shape), blocks)  # [parts, T, out/parts]
    return out.transpose(0, 1).reshape(x.shape[0], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           kernels: NativeKernels | None = None, native_rows: int = 0) -> torch.Tensor:
    """F.linear(x, weight, bias) for x `[T, in]`; contiguous `[T, out]`. Up to `native_rows` rows (the caller's
    `KernelPolicy.dense_rows`) through latentserve's kernel `kernels`."""
    if batch_invariant.is_enabled():
        out = _row_wise_linear(x, weight, kernels)
        return out if bias is None else out.add_(bias)
    if x.device.type != "cpu" or x.dim() != 2 or x.dtype not in SKINNY_ROWS:
        return F.linear(x, weight, bias)
    threads, rows = torch.get_num_threads(), x.shape[0]
    if (kernels is not None and rows <= native_rows and weight.dtype == x.dtype in native.KERNEL_DTYPES
            and weight.is_contiguous()):
        out = native.dense_linear(kernels, x.contiguous(), weight, x.dtype)
        return out if bias is None else out.add_(bias)
    if threads == 1:
        return F.linear(x, weight, bias)
    if x.dtype == torch.float32 and rows in SPLIT_ROWS and weight.shape[0] % threads == 0:
        out = _split_gemm(x, weight, threads)
    elif rows in SKINNY_ROWS[x.dtype]:
        out = torch.mm(weight, x.t()).t().contiguous()
    else:
        return F.linear(x, weight, bias)
    return out if bias is None else out.add_(bias)


def _row_wise_linear(x: torch.Tensor, weight: torch.Tensor, kernels: NativeKernels | None) -> torch.Tensor:
    """x @ Wᵀ through latentserve's kernel at any row count: each row's sums in one order, whatever the others."""
    if (kernels is None or x.device.type != "cpu" or x.dim() != 2 or x.dtype != weight.dtype
            or x.dtype not in native.KERNEL_DTYPES):
        raise RuntimeError(f"batch-invariant mode runs linears on latentserve's CPU kernels, which do not take "
                           f"{x.dtype} x {tuple(x.shape)} @ {weight.dtype} weight on {x.device}")
    return native.dense_linear(kernels, x.contiguous(), weight.contiguous(), x.dtype)


def head_products(x: torch.Tensor, w: torch.Tensor, kernels: NativeKernels | None = None,
                  native_tokens: int = 0) -> torch.Tensor:
    """y[t, h] = x[t, h] @ w[h] for x `[T, H, K]` and w `[H, K, N]`: `[T, H, N]`; up to `native_tokens` tokens (the
    caller's `KernelPolicy.head_tokens`) through latentserve's kernel `kernels`."""
    few = x.shape[0] <= native_tokens or batch_invariant.is_enabled()
    if (kernels is not None and x.device.type == "cpu" and few and x.dtype == w.dtype
            and w.dtype in native.KERNEL_DTYPES and w.shape[2] % 16 == 0 and w.is_contiguous()):
        return native.dense_heads(kernels, x.contiguous(), w, x.dtype)
    return torch.bmm(x.transpose(0, 1), w).transpose(0, 1)


class Linear(nn.Linear):
    """nn.Linear through `linear`, its kernel chosen once by `process_weights_after_loading` (the loader's policy;
    a layer built outside a loader asks `default_policy()` at its first call)."""

    kernels: NativeKernels | None = None
    native_rows: int | None = None  # up to how many rows `kernels` runs it; None: not asked yet

    def process_weights_after_loading(self, policy: KernelPolicy) -> None:
        self.kernels = policy.kernels
        self.native_rows = policy.dense_rows(self.weight.dtype, self.in_features)

    def native_weight(self, dtype: torch.dtype, kernels: NativeKernels) -> tuple[native.Weight, int] | None:
        """(this layer as a one-call block reads it, up to how many rows it runs latentserve's kernel) where it runs
        `kernels` on `dtype` activations without a bias; else None."""
        if self.native_rows is None:
            self.process_weights_after_loading(default_policy())
        w = self.weight
        if self.kernels != kernels or self.bias is not None or w.dtype != dtype or not w.is_contiguous():
            return None
        return native.Weight(kind=native.DENSE, w=w.data_ptr()), self.native_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native_rows is None:
            self.process_weights_after_loading(default_policy())
        return linear(x, self.weight, self.bias, self.kernels, self.native_rows)
