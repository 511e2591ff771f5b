"""The linear layers' wrappers: int8, int4, Q6_K, Q5_0, Q5_1, Q5_K and Q4_K weights (`packing.py`'s layouts), dense
fp32 / bf16 ones, MLA's per-head products, and RMSNorm."""
from __future__ import annotations

from typing import Callable

import torch

from latentserve.kernels.abi import desc
from latentserve.kernels.build import NativeKernels
from latentserve.kernels.checks import tensor
from latentserve.kernels.native.calls import F32, I8, I32, KERNEL_DTYPES, call, refused, written_dtype
from latentserve.kernels.native.packing import (check_int4, check_int8, check_q2k, check_q3k, check_q4k, check_q5k,
                                                check_q6k, check_q50, check_q51)


def _packed_linear(kernels: NativeKernels, fn: str, x: torch.Tensor, check, out_features: int,
                   out_dtype: torch.dtype, *weight) -> torch.Tensor:
    """`[M, out_features]` from ls_`fn`(x, *weight, y), x `[M, K]` and `check(K)` checked first."""
    m, k = tensor(fn, "x", x, KERNEL_DTYPES, (None, None))
    check(k)
    y = torch.empty(m, out_features, dtype=written_dtype(out_dtype))
    refused(kernels, fn, call(kernels, f"ls_{fn}", desc(x), *weight, desc(y), torch.get_num_threads()))
    return y


def int8_linear(kernels: NativeKernels, x: torch.Tensor, packed: torch.Tensor, out_features: int,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`[M, out_features]` = x `[M, K]` (`activations`) times the int8 weight `packed` by `pack_int8`; in `out_dtype`
    where the kernels write it, else fp32."""
    return _packed_linear(kernels, "int8_linear", x, lambda k: check_int8("int8_linear", "packed", packed,
                                                                          out_features, k),
                          out_features, out_dtype, desc(packed))


def _int8_scales(fn: str, scale: torch.Tensor, qsum: torch.Tensor, rows: int) -> None:
    tensor(fn, "scale", scale, F32, numel=rows)
    tensor(fn, "qsum", qsum, I32, numel=rows)


def _int8(kernels: NativeKernels, name: str, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
          qsum: torch.Tensor, shape: tuple[int, ...], out_dtype: torch.dtype) -> torch.Tensor:
    """y of `shape` from kernel `name` (ls_int8_heads or its lanes form), the arguments checked."""
    y = torch.empty(shape, dtype=written_dtype(out_dtype))
    refused(kernels, name, call(kernels, name, desc(x), desc(q), desc(scale), desc(qsum), desc(y),
                                torch.get_num_threads()))
    return y


def int8_heads(kernels: NativeKernels, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, qsum: torch.Tensor,
               out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`[M, H, N]`: y[m, h] = x[m, h] @ w[h]^T for x `[M, H, K]` (contiguous, fp32 or bf16), the int8 weights q
    `[H, N, K]` with per-row `scale` and `qsum` (q.sum(-1), int32) `[H, N]`."""
    m, h, k = tensor("int8_heads", "x", x, KERNEL_DTYPES, (None, None, None))
    _, n, _ = tensor("int8_heads", "q", q, I8, (h, None, k))
    _int8_scales("int8_heads", scale, qsum, h * n)
    return _int8(kernels, "ls_int8_heads", x, q, scale, qsum, (m, h, n), out_dtype)


def int8_heads_lanes(kernels: NativeKernels, x: torch.Tensor, lanes: torch.Tensor, scale: torch.Tensor,
                     qsum: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`int8_heads` with the weight in `int8_lanes`' layout: the same outputs, short rows read as one stream."""
    m, h, k = tensor("int8_heads_lanes", "x", x, KERNEL_DTYPES, (None, None, None))
    if k % 4:
        raise ValueError(f"int8_heads_lanes: x's rows of {k} are not a multiple of 4 columns (int8_lanes' layout)")
    n = tensor("int8_heads_lanes", "lanes", lanes, I8, (h, None, k // 4, 16, 4))[1] * 16
    _int8_scales("int8_heads_lanes", scale, qsum, h * n)
    return _int8(kernels, "ls_int8_heads_lanes", x, lanes, scale, qsum, (m, h, n), out_dtype)


def dense_linear(kernels: NativeKernels, x: torch.Tensor, weight: torch.Tensor,
                 out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`[M, N]` = x `[M, K]` (`activations`) @ weight`[N, K]`ᵀ for a contiguous fp32 or bf16 weight, fp32 sums; in
    `out_dtype` where the kernels write it, else fp32."""
    m, k = tensor("dense_linear", "x", x, KERNEL_DTYPES, (None, None))
    n, _ = tensor("dense_linear", "weight", weight, KERNEL_DTYPES, (None, k))
    y = torch.empty(m, n, dtype=written_dtype(out_dtype))
    refused(kernels, "dense_linear", call(kernels, "ls_dense_linear", desc(x), desc(weight), desc(y),
                                          torch.get_num_threads()))
    return y


def dense_heads(kernels: NativeKernels, x: torch.Tensor, w: torch.Tensor,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`[M, H, N]`: y[m, h] = x[m, h] @ w[h] for x `[M, H, K]` (contiguous, fp32 or bf16) and a contiguous fp32 or
    bf16 w `[H, K, N]` (bmm's layout) with N a multiple of 16; fp32 sums."""
    m, h, k = tensor("dense_heads", "x", x, KERNEL_DTYPES, (None, None, None))
    n = tensor("dense_heads", "w", w, KERNEL_DTYPES, (h, k, None))[2]
    if n % 16:
        raise ValueError(f"dense_heads: w [H, K, N] must have N % 16 == 0, got {list(w.shape)}")
    y = torch.empty(m, h, n, dtype=written_dtype(out_dtype))
    refused(kernels, "dense_heads", call(kernels, "ls_dense_heads", desc(x), desc(w), desc(y),
                                         torch.get_num_threads()))
    return y


def int4_linear(kernels: NativeKernels, x: torch.Tensor, packed: torch.Tensor, group_size: int, out_features: int,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`[M, out_features]` = x `[M, K]` (`activations`) times the int4 weight `packed` by `pack_int4`; in `out_dtype`
    where the kernels write it, else fp32."""
    return _packed_linear(kernels, "int4_linear", x, lambda k: check_int4("int4_linear", "packed", packed,
                                                                          out_features, k, group_size),
                          out_features, out_dtype, desc(packed), group_size)


def _file_blocks(fn: str, check: Callable[[str, str, torch.Tensor, int, int], None], layout: str):
    """The wrapper of ls_`fn`, a linear layer over one of llama.cpp's formats kept as its blocks (`layout`'s)."""

    def linear(kernels: NativeKernels, x: torch.Tensor, packed: torch.Tensor, out_features: int,
               out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return _packed_linear(kernels, fn, x, lambda k: check(fn, "packed", packed, out_features, k), out_features,
                              out_dtype, desc(packed))

    linear.__name__ = linear.__qualname__ = fn
    linear.__doc__ = (f"`[M, out_features]` = x `[M, K]` (`activations`) times the weight `packed` by `{layout}`; in "
                      "`out_dtype` where the kernels write it, else fp32.")
    return linear


q6k_linear = _file_blocks("q6k_linear", check_q6k, "pack_q6k")  # Q6_K
q2k_linear = _file_blocks("q2k_linear", check_q2k, "pack_q2k")  # Q2_K
q3k_linear = _file_blocks("q3k_linear", check_q3k, "pack_q3k")  # Q3_K
q50_linear = _file_blocks("q50_linear", check_q50, "pack_q50")  # Q5_0
q51_linear = _file_blocks("q51_linear", check_q51, "pack_q51")  # Q5_1
q5k_linear = _file_blocks("q5k_linear", check_q5k, "pack_q5k")  # Q5_K
q4k_linear = _file_blocks("q4k_linear", check_q4k, "pack_q4k")  # Q4_K


def argmax(kernels: NativeKernels, x: torch.Tensor) -> torch.Tensor:
    """int64 `[M]`: the index of each row's first maximum of fp32 x `[M, V]` (V >= 1), as `x.argmax(-1)` (a NaN
    the maximum)."""
    rows, size = tensor("argmax", "x", x, (torch.float32,), (None, None))
    if size == 0:
        raise ValueError(f"argmax: x must have values in each row, got {list(x.shape)}")
    out = torch.empty(rows, dtype=torch.int64)
    refused(kernels, "argmax", call(kernels, "ls_argmax", desc(x), desc(out), torch.get_num_threads()))
    return out


def rms_norm(kernels: NativeKernels, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over x's last dimension in fp32, x and `weight` both fp32 or both bf16 (bf16: the normalized x
    rounds to bf16 before the weight multiplies it); in x's dtype and shape."""
    shape = tensor("rms_norm", "x", x, KERNEL_DTYPES, contiguous=False)
    if not shape:
        raise ValueError("rms_norm: x must have at least one dimension, got a scalar")
    tensor("rms_norm", "weight", weight, (x.dtype,), (shape[-1],))
    rows = x.reshape(-1, shape[-1]).contiguous()
    y = torch.empty_like(rows)
    refused(kernels, "rms_norm", call(kernels, "ls_rms_norm", desc(rows), desc(weight), eps, desc(y),
                                      torch.get_num_threads()))
    return y.view(x.shape)
