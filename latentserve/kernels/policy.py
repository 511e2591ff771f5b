"""`KernelPolicy`: which of latentserve's CPU kernels this process runs and up to how many rows, decided once.

The engine builds one (CPU features, `LATENTSERVE_NATIVE_KERNELS`, torch's threads, the loaded library) and hands it
to the loader; each layer asks it once, after its weights are loaded (`process_weights_after_loading`), and keeps the
answer. `latentserve backends` prints the same object. Modules built outside a loader (tests, benchmarks) ask
`default_policy()` at their first call."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from latentserve.kernels.build import NATIVE_ENV, NativeKernels, native_kernels
from latentserve.kernels.cpu import CpuFeatures, cpu_features, cpu_vendor

# MLA's absorbed per-head products: up to this many tokens latentserve's kernel beats bmm (V2-Lite's and the 94M
# V3's heads, weights streamed: 1.4-2.1x fp32 and 1.5-3.8x bf16 at 1-4 tokens on 2 threads; at 8 tokens 0.98-1.33x
# fp32 and 1.06-1.53x bf16, where bf16 bmm also copies its strided operand; at 12 bmm wins bf16 and ties fp32).
HEAD_TOKENS = 8


@dataclass(frozen=True)
class KernelPolicy:
    features: CpuFeatures
    kernels: NativeKernels | None  # the loaded library; None: PyTorch's kernels everywhere
    why: str  # why this build runs, or why none does
    threads: int  # torch's intra-op threads the row limits are chosen for

    @classmethod
    def detect(cls, threads: int | None = None) -> KernelPolicy:
        """This process's policy: the CPU as torch dispatches on it, `LATENTSERVE_NATIVE_KERNELS`, `threads` (None:
        torch's current setting)."""
        features = cpu_features()
        kernels, why = native_kernels(features)
        return cls(features, kernels, why, threads or torch.get_num_threads())

    @property
    def unavailable(self) -> str | None:
        """Why a backend built on latentserve's kernels cannot run here; None where the kernels are used."""
        return None if self.kernels is not None else f"latentserve's kernels are not used ({self.why})"

    def dense_rows(self, dtype: torch.dtype, in_features: int) -> int:
        """Up to how many rows latentserve's fp32/bf16 linear (kernels/gemv.c) beats the other layouts, as measured
        with weights streamed (benchmarks/RESULTS.md); 0: never. fp32: 1.25-1.8x at 1-3 rows on 2 threads, 1.3-3.8x
        F.linear on one, even at 4. bf16 at 1 row: 1.5-3x. At 2-4 rows bf16 depends on the input width: over short
        rows (<= 512, small models' hidden sizes and experts) oneDNN's fixed cost dominates and the kernel wins
        1.4-2.8x. Over wider rows (V2-Lite's 2048) the build with vdpbf16ps wins 1.2-1.7x at 2-3 rows on 1-2 threads
        and ties at 4; the others win 1.0-1.3x at 2 rows on 2 threads but lose on one (0.87-0.97x), and lose from 3
        rows on."""
        if self.kernels is None:
            return 0
        if dtype == torch.float32:
            return 3
        if dtype == torch.bfloat16:
            if in_features <= 512:
                return 4
            if self.kernels.bf16_dot:
                return 3
            return 2 if self.threads > 1 else 1
        return 0

    def native_prefill(self, dtype: torch.dtype) -> bool:
        """Whether latentserve's prefill attention (kernels/prefill_attention.c) goes before PyTorch's flash kernel
        for `dtype`: wherever the kernels run, but for bf16 on a CPU with AMX tiles, where oneDNN runs torch's bf16
        products on them (an Intel Xeon, 2 threads, the backends alone: torch's 2.9-5x ours at 512-4096 tokens, a
        whole 4096-token prefill 1.5x; fp32 there ours 1.1-1.7x; benchmarks/RESULTS.md "Prefill attention on AMX")."""
        tiles = dtype == torch.bfloat16 and self.features.amx and self.features.onednn_bf16
        return self.kernels is not None and not tiles

    @property
    def head_tokens(self) -> int:
        """Up to how many tokens MLA's fp32/bf16 absorbed per-head products run latentserve's kernel; 0: never."""
        return HEAD_TOKENS if self.kernels is not None else 0

    def describe(self) -> str:
        """The policy in a few lines, as `latentserve backends` prints it."""
        build = f"built for {self.kernels.isa}" if self.kernels is not None else "not used"
        lines = [f"features: {self.features.describe()}", f"latentserve's kernels: {build} ({self.why})",
                 f"threads: {self.threads}"]
        if self.kernels is not None:
            ahead = self.kernels.read_ahead
            lines.append(f"weight read-ahead at few rows: {f'{ahead} bytes' if ahead else 'none'} "
                         f"({cpu_vendor() or 'maker unknown'})")
        if self.kernels is not None:
            fp32, bf16, short = (self.dense_rows(dtype, width) for dtype, width in
                                 ((torch.float32, 2048), (torch.bfloat16, 2048), (torch.bfloat16, 512)))
            lines.append(f"fp32 / bf16 linears: latentserve's up to {fp32} fp32 rows and {bf16} bf16 rows ({short} "
                         "over inputs of <= 512), MKL / oneDNN above")
            lines.append(f"absorbed per-head products: latentserve's up to {self.head_tokens} tokens, bmm above")
            if not self.native_prefill(torch.bfloat16):
                lines.append("prefill attention in bf16: PyTorch's flash kernel first (its products on AMX tiles)")
        return "\n".join(lines)


@functools.cache
def _default(setting: str | None, capability: str, threads: int) -> KernelPolicy:
    return KernelPolicy.detect(threads)


def default_policy() -> KernelPolicy:
    """The policy a module built outside a loader runs under: `KernelPolicy.detect()`, looked up once per setting of
    `LATENTSERVE_NATIVE_KERNELS`, CPU capability and thread count."""
    return _default(os.environ.get(NATIVE_ENV), torch.backends.cpu.get_cpu_capability(), torch.get_num_threads())
