"""What every wrapper of the native kernels shares: the dtypes the kernels read and write, the call itself (inside a
profiler range while torch's profiler runs) and what a refused call raises."""
from __future__ import annotations

import torch

from latentserve.kernels import abi
from latentserve.kernels.abi import MLABlock, MoEBlock
from latentserve.kernels.build import NativeKernels


KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # what the kernels read and write; other dtypes go through fp32
KV_CACHE_DTYPES = (*KERNEL_DTYPES, torch.float8_e4m3fn, torch.int8)  # the latent caches they read and write (kv_rows.h)
F32, I8, I32, I64, U8 = (torch.float32,), (torch.int8,), (torch.int32,), (torch.int64,), (torch.uint8,)
PROFILE_PREFIX = "latentserve::"  # the profiler range each call gets while a torch profiler runs


def call(kernels: NativeKernels, name: str, *args):
    """kernels.lib.`name`(*args) and what it returns, inside a profiler range named after it while torch's profiler
    runs (ctypes calls are invisible to it otherwise)."""
    fn = getattr(kernels.lib, name)
    # The profiler's module-level flag: torch.autograd._profiler_enabled() stays False under an all-threads profile.
    if torch.autograd.profiler._is_profiler_enabled:
        with torch.profiler.record_function(PROFILE_PREFIX + name):
            return fn(*args)
    return fn(*args)


def refused(kernels: NativeKernels, fn: str, code: int) -> None:
    """Raise what a nonzero ls_status the wrappers do not explain themselves means: the descriptor or block struct
    the kernel refused (ls_last_error names it), or a MemoryError."""
    if code == abi.NO_MEMORY:
        raise MemoryError(f"{fn}: the kernels' scratch arena could not grow")
    if code:
        raise ValueError(f"{fn}: {kernels.lib.ls_last_error().decode()} (status {code})")


def activations(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """x as the kernels take it: `[rows, in_features]`, contiguous, fp32 or bf16."""
    if x.shape[-1] != in_features:  # a reshape alone would regroup a wrong width's values into rows
        raise ValueError(f"x has {x.shape[-1]} columns, the layer takes {in_features}")
    x = x.reshape(-1, in_features)
    return (x if x.dtype in KERNEL_DTYPES else x.float()).contiguous()


def written_dtype(out_dtype: torch.dtype) -> torch.dtype:
    """The output's dtype: `out_dtype` where the kernels write it, else fp32."""
    return out_dtype if out_dtype in KERNEL_DTYPES else torch.float32


def block_dtype(block: MLABlock | MoEBlock) -> torch.dtype:
    return torch.bfloat16 if block.bf else torch.float32
