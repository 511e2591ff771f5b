"""Every build this CPU can run compiles: a source that stops compiling would otherwise only make the kernel tests
skip (their callers fall back to PyTorch's kernels)."""
from __future__ import annotations

import os
import shutil

import pytest

from latentserve.kernels import native
from tests.kernels.builds import ISAS


@pytest.mark.skipif(not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")
@pytest.mark.parametrize("isa", ISAS)
def test_every_runnable_build_compiles(isa):
    built = native.load(isa)
    if isinstance(built, str) and isa in native.FALLBACK and "avx512bf16" in built:
        pytest.skip(f"this compiler has no {isa} (the engine falls back to {native.FALLBACK[isa]}): {built}")
    assert not isinstance(built, str), built
    assert hasattr(built.lib, "ls_moe_block") and hasattr(built.lib, "ls_experts_tokens")
