"""The builds of latentserve's kernels this machine can run (build.runnable_isas): the AVX2 build runs on any AVX-512
machine too, the avx512_bf16 one on an AMX machine, avx2_vnni wherever the CPU has AVX-VNNI."""
from __future__ import annotations

import os
import shutil

import pytest

from latentserve.kernels import native
from latentserve.kernels.cpu import cpu_features
from latentserve.kernels.policy import default_policy


ISAS = native.runnable_isas(cpu_features())
needs_a_build = pytest.mark.skipif(not ISAS, reason="no AVX2 on this CPU")
needs_a_compiler = pytest.mark.skipif(not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")),
                                      reason="no C compiler")
# What models and layers built by the engine's own choice run: without the kernels (no compiler, or
# LATENTSERVE_NATIVE_KERNELS=0) they take PyTorch's, and tests of the kernels' paths through them skip.
needs_the_engines_kernels = pytest.mark.skipif(default_policy().kernels is None,
                                               reason=f"the engine runs PyTorch's kernels: {default_policy().why}")


def kernels(isa: str) -> native.NativeKernels:
    """The build for `isa`, or skip where it cannot be built."""
    built = native.load(isa)
    if isinstance(built, str):
        pytest.skip(f"{isa} build unavailable: {built}")
    return built
