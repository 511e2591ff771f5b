"""The builds of latentserve's kernels this machine can run (build.runnable_isas): the AVX2 build runs on any AVX-512
machine too, the avx512_bf16 one on an AMX machine, avx2_vnni wherever the CPU has AVX-VNNI."""
from __future__ import annotations

import pytest

from latentserve.kernels import native
from latentserve.kernels.cpu import cpu_features


ISAS = native.runnable_isas(cpu_features())
needs_a_build = pytest.mark.skipif(not ISAS, reason="no AVX2 on this CPU")


def kernels(isa: str) -> native.NativeKernels:
    """The build for `isa`, or skip where it cannot be built."""
    built = native.load(isa)
    if isinstance(built, str):
        pytest.skip(f"{isa} build unavailable: {built}")
    return built
