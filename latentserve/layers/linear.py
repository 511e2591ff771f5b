"""`Linear`: nn.Linear whose skinny CPU products keep every thread streaming weights: latentserve's own kernel at
a few rows, layouts that make MKL and oneDNN do so above."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from latentserve import batch_invariant
from latentserve.kernels import native

# Layouts by row count with several threads (benchmarks/RESULTS.md, "Skinny products by dtype"). fp32: MKL runs a
# one-row product on one thread, and x @ Wᵀ keeps threads idle up to a few dozen rows; a bmm over row blocks of W
# (one per thread) wins at 1 and 4-8 rows, W @ xᵀ at the other counts up to 32. bf16/fp16 go through oneDNN,
# which keeps its threads busy: x @ Wᵀ is fastest up to 16 rows, W @ xᵀ from 17 to 32.
SPLIT_ROWS = (1, 4, 5, 6, 7, 8)
SKINNY_ROWS = {torch.float32: range(2, 33), torch.bfloat16: range(17, 33), torch.float16: range(17, 33)}


def native_rows(dtype: torch.dtype, in_features: int, threads: int, kernels: native.NativeKernels) -> int:
    """Up to how many rows latentserve's kernel (kernels/gemv.c) beats the other layouts, as measured with weights
    streamed (benchmarks/RESULTS.md). fp32: 1.25-1.8x at 1-3 rows on 2 threads, 1.3-3.8x F.linear on one, even at
    4. bf16 at 1 row: 1.5-3x. At 2-4 rows bf16 depends on the input width: over short rows (<= 512, small models'
    hidden sizes and experts) oneDNN's fixed cost dominates and the kernel wins 1.4-2.8x. Over wider rows (V2-Lite's
    2048) the build with vdpbf16ps wins 1.2-1.7x at 2-3 rows on 1-2 threads and ties at 4; the others win 1.0-1.3x
    at 2 rows on 2 threads but lose on one (0.87-0.97x), and lose from 3 rows on."""
    if dtype == torch.float32:
        return 3
    if dtype == torch.bfloat16:
        if in_features <= 512:
            return 4
        if kernels.bf16_dot:
            return 3
        return 2 if threads > 1 else 1
    return 0


# MLA's absorbed per-head products: up to this many tokens latentserve's kernel beats bmm (V2-Lite's and the 94M
# V3's heads, weights streamed: 1.4-2.1x fp32 and 1.5-3.8x bf16 at 1-4 tokens on 2 threads; at 8 tokens 0.98-1.33x
# fp32 and 1.06-1.53x bf16, where bf16 bmm also copies its strided operand; at 12 bmm wins bf16 and ties fp32).
NATIVE_HEAD_TOKENS = 8


def _split_gemm(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """x `[T, in]` @ Wᵀ as one bmm over `parts` row blocks of W (views, nothing copied): each thread streams its
    own block."""
    blocks = weight.unflatten(0, (parts, -1)).transpose(1, 2)  # [parts, in, out/parts]
    out = torch.bmm(x.expand(parts, *x.shape), blocks)  # [parts, T, out/parts]
    return out.transpose(0, 1).reshape(x.shape[0], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x `[T, in]`; contiguous `[T, out]`."""
    if batch_invariant.is_enabled():
        out = _row_wise_linear(x, weight)
        return out if bias is None else out.add_(bias)
    if x.device.type != "cpu" or x.dim() != 2 or x.dtype not in SKINNY_ROWS:
        return F.linear(x, weight, bias)
    threads, rows = torch.get_num_threads(), x.shape[0]
    if weight.dtype == x.dtype and weight.is_contiguous():
        kernels = native.for_this_cpu()
        if kernels is not None and rows <= native_rows(x.dtype, x.shape[1], threads, kernels):
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


def _row_wise_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ Wᵀ through latentserve's kernel at any row count: each row's sums in one order, whatever the others."""
    kernels = native.for_this_cpu() if x.device.type == "cpu" else None
    if kernels is None or x.dim() != 2 or x.dtype != weight.dtype or x.dtype not in native.KERNEL_DTYPES:
        raise RuntimeError(f"batch-invariant mode runs linears on latentserve's CPU kernels, which do not take "
                           f"{x.dtype} x {tuple(x.shape)} @ {weight.dtype} weight on {x.device}")
    return native.dense_linear(kernels, x.contiguous(), weight.contiguous(), x.dtype)


def head_products(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y[t, h] = x[t, h] @ w[h] for x `[T, H, K]` and w `[H, K, N]`: `[T, H, N]`."""
    few = x.shape[0] <= NATIVE_HEAD_TOKENS or batch_invariant.is_enabled()
    if (x.device.type == "cpu" and few and x.dtype == w.dtype
            and w.dtype in native.KERNEL_DTYPES and w.shape[2] % 16 == 0 and w.is_contiguous()):
        kernels = native.for_this_cpu()
        if kernels is not None:
            return native.dense_heads(kernels, x.contiguous(), w, x.dtype)
    return torch.bmm(x.transpose(0, 1), w).transpose(0, 1)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
