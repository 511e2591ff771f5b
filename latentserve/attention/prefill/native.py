"""NATIVE: prefill attention in one C call per request (kernels/prefill_attention.c), on the CPU: exact softmax over
each query's whole row of keys, bf16 products through vdpbf16ps where the build has them. Against PyTorch's CPU flash
kernel on MLA's shapes (16 heads, D 192, V 128, 512-4096 tokens, 2 threads, AMD Zen 4): bf16 2.5-4.2x, fp32 1.2-2.3x
(benchmarks/RESULTS.md "Prefill attention")."""
from __future__ import annotations

from typing import Any

import torch

from latentserve.attention.backend import NativeKernelsBackend
from latentserve.attention.prefill.varlen import VarlenPrefillBackend
from latentserve.kernels import native
from latentserve.kernels.policy import default_policy


class NativePrefillBackend(NativeKernelsBackend, VarlenPrefillBackend):
    supports_sliding_window = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kernels = default_policy().kernels

    def _attend(self, q, k, v, causal, distance):
        if q.dtype not in native.KERNEL_DTYPES:  # fp16: the kernel reads fp32 and bf16
            out, lse = self._attend(q.float(), k.float(), v.float(), causal, distance)
            return out.to(q.dtype), lse
        return native.prefill_attention(self.kernels, q, k, v, causal, distance, self.sliding_window, self.scale)
