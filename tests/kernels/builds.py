"""The builds of latentserve's kernels this machine can run: the AVX2 build runs on any AVX-512 machine too, the
avx512_bf16 one on an AMX machine."""
from __future__ import annotations

import pytest

from latentserve.kernels import native
from latentserve.kernels.cpu import cpu_features


def _runnable_isas() -> list[str]:
    here = cpu_features()
    isas = []
    if here.capability.startswith("AVX512") and here.vnni:
        isas += ["avx512_amx"] if here.avx512_bf16 and here.amx else []
        isas += ["avx512_bf16", "avx512_vnni"] if here.avx512_bf16 else ["avx512_vnni"]
    if here.capability.startswith(("AVX512", "AVX2")):
        isas.append("avx2")
    return isas


ISAS = _runnable_isas()
needs_a_build = pytest.mark.skipif(not ISAS, reason="no AVX2 on this CPU")


def kernels(isa: str) -> native.NativeKernels:
    """The build for `isa`, or skip where it cannot be built."""
    built = native.load(isa)
    if isinstance(built, str):
        pytest.skip(f"{isa} build unavailable: {built}")
    return built
