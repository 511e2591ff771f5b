"""Under `make sanitize` (kernels built with -fsanitize=address,undefined): what test_boundary.py's checks refuse is
a real memory error. Each case calls the C function itself, past its wrapper, with the arguments the wrapper
refuses (where the kernel checks indices itself, with sizes that lie so that its check passes), in a child process,
and AddressSanitizer reports the access. Skipped in ordinary builds."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.kernels.builds import ISAS, kernels, needs_a_build

pytestmark = [needs_a_build, pytest.mark.skipif("-fsanitize=address" not in os.environ.get("CC", ""),
                                                reason="kernels not built with AddressSanitizer (make sanitize)")]

SETUP = f"""
import torch
from latentserve.kernels import native
lib = native.load({ISAS[0] if ISAS else "avx2"!r}).lib
"""

CASES = {
    # dense_linear with a weight narrower than x: reads past the weight's last row.
    "dense_linear": """
        x, w, y = torch.randn(1, 64), torch.randn(8, 16), torch.empty(1, 8)
        lib.ls_dense_linear(x.data_ptr(), 1, 64, w.data_ptr(), 8, y.data_ptr(), 0, 1)
    """,
    # rms_norm with a weight shorter than the row.
    "rms_norm": """
        x, w, y = torch.randn(1, 100), torch.randn(50), torch.empty(1, 100)
        lib.ls_rms_norm(x.data_ptr(), 1, 100, w.data_ptr(), 1e-6, y.data_ptr(), 0, 1)
    """,
    # mla_prologue with a slot one past the cache (its capacity said to be huge): writes past it.
    "mla_prologue": """
        q, kv, w = torch.randn(1, 2, 32), torch.randn(1, 48), torch.randn(32)
        cos, sin, cache = torch.ones(1, 16), torch.zeros(1, 16), torch.zeros(3, 4, 48)
        kv_c, k_pe, slots = torch.empty(1, 32), torch.empty(1, 16), torch.tensor([12])
        lib.ls_mla_prologue(q.data_ptr(), 1, 2, 32, kv.data_ptr(), 32, 16, w.data_ptr(), 1e-6, cos.data_ptr(),
                            sin.data_ptr(), 2, kv_c.data_ptr(), k_pe.data_ptr(), cache.data_ptr(), slots.data_ptr(),
                            0, 1, 1 << 40)
    """,
    # mla_decode with a block id one past the cache (its blocks said to be many): reads past it.
    "mla_decode": """
        q, cache, out = torch.randn(1, 2, 48), torch.randn(3, 4, 48), torch.empty(1, 2, 32)
        table, qsl, lens = (torch.tensor(v, dtype=torch.int32) for v in ([[3]], [0, 1], [4]))
        lib.ls_mla_decode(q.data_ptr(), 1, 2, 48, 32, cache.data_ptr(), 4, table.data_ptr(), 1, qsl.data_ptr(),
                          lens.data_ptr(), 1, 0.1, out.data_ptr(), 0, 1, 1 << 40, 1)
    """,
}


@pytest.mark.parametrize("case", CASES)
def test_what_the_checks_refuse_is_a_memory_error(case):
    kernels(ISAS[0])  # built here first: each child then loads it from the cache
    code = SETUP + textwrap.dedent(CASES[case])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "ERROR: AddressSanitizer" in done.stderr, done.stderr[-2000:]
