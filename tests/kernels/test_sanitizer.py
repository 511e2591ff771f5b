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
from latentserve.kernels import abi, native
lib = native.load({ISAS[0] if ISAS else "avx2"!r}).lib
d = abi.desc


def lie(t, *shape):  # t's descriptor claiming `shape` (contiguous strides): what a caller past the wrappers could pass
    strides = [1]
    for size in reversed(shape[1:]):
        strides.insert(0, strides[0] * size)
    return abi._PACKERS[len(shape)].pack(t.data_ptr(), abi.DTYPES[t.dtype], len(shape), *shape, *strides)
"""

CASES = {
    # dense_linear with a weight narrower than x, its descriptor claiming x's width: reads past the weight's end.
    "dense_linear": """
        x, w, y = torch.randn(1, 64), torch.randn(8, 16), torch.empty(1, 8)
        lib.ls_dense_linear(d(x), lie(w, 8, 64), d(y), 1)
    """,
    # rms_norm with a weight shorter than the row.
    "rms_norm": """
        x, w, y = torch.randn(1, 100), torch.randn(50), torch.empty(1, 100)
        lib.ls_rms_norm(d(x), lie(w, 100), 1e-6, d(y), 1)
    """,
    # argmax over rows said far longer than they are: reads past x's end.
    "argmax": """
        x, out = torch.randn(2, 16), torch.empty(2, dtype=torch.int64)
        lib.ls_argmax(lie(x, 2, 1 << 16), d(out), 1)
    """,
    # mla_prologue with a slot one past the cache (the cache said to be much larger): writes past it.
    "mla_prologue": """
        q, kv, w = torch.randn(1, 2, 32), torch.randn(1, 48), torch.randn(32)
        cos, sin, cache = torch.ones(1, 16), torch.zeros(1, 16), torch.zeros(3, 4, 48)
        kv_c, k_pe, slots = torch.empty(1, 32), torch.empty(1, 16), torch.tensor([12])
        lib.ls_mla_prologue(d(q), d(kv), d(w), 1e-6, d(cos), d(sin), 2, d(kv_c), d(k_pe), lie(cache, 1 << 20, 4, 48),
                            d(slots), 1)
    """,
    # mla_decode with a block id one past the cache (the cache said to hold many blocks): reads past it.
    "mla_decode": """
        q, cache, out = torch.randn(1, 2, 48), torch.randn(3, 4, 48), torch.empty(1, 2, 32)
        table, qsl, lens = (torch.tensor(v, dtype=torch.int32) for v in ([[3]], [0, 1], [4]))
        lib.ls_mla_decode(d(q), lie(cache, 1 << 20, 4, 48), d(table), d(qsl), d(lens), 0.1, d(out), 1)
    """,
    # prefill_attention with v said to hold as many keys as k, holding fewer: reads past its end.
    "prefill_attention": """
        q, k, v = torch.randn(4, 2, 8), torch.randn(64, 2, 8), torch.randn(2, 2, 6)
        out, lse = torch.empty(4, 2, 6), torch.empty(4, 2)
        lib.ls_prefill_attention(d(q), d(k), lie(v, 64, 2, 6), 0, 0, 0, 0.3, d(out), d(lse), 1)
    """,
    # each kept format's weight (the bytes of a block of 256 columns) said to hold 8 blocks of 16 outputs, holding 1:
    # reads past its end.
    **{f"{fmt}_linear": f"""
        packed = torch.zeros(1, {width}, dtype=torch.uint8)
        x, y = torch.randn(1, 256), torch.empty(1, 128)
        lib.ls_{fmt}_linear(d(x), lie(packed, 8, {width}), d(y), 1)
    """ for fmt, width in (("q6k", 3392), ("q3k", 1856), ("q2k", 1408), ("q50", 2816), ("q51", 3072), ("q5k", 2944),
                           ("q4k", 2432))},
    # experts whose table says them wider than their weights: reads past gate_up's end.
    "experts": """
        w13, w2 = torch.randn(1, 16, 16), torch.randn(1, 16, 8)
        table = native.expert_table(list(zip(w13, w2)), 16, 8, ((32, 0), (32, 0)))
        table.table.inter = 64
        x, y = torch.randn(1, 16), torch.empty(1, 16)
        ids, weights = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1)
        lib.ls_experts(table.table, None, d(x), d(ids), d(weights), d(y), 1)
    """,
    # decode_layers with both caches said to hold many blocks and a slot one past them: layer 0 writes past its cache.
    "decode_layers": """
        from tests.kernels.test_abi import _layers
        stack, built = _layers(0, 2)
        x, cos, sin, y = torch.randn(1, 32), torch.ones(1, 16), torch.zeros(1, 16), torch.empty(1, 32)
        caches = [torch.zeros(2, 4, 32) for _ in range(2)]
        table, qsl, lens = (torch.tensor(v, dtype=torch.int32) for v in ([[0, 1]], [0, 1], [1]))
        lib.ls_decode_layers(stack.attention, stack.moe, b"".join(lie(c, 1 << 20, 4, 32) for c in caches), 2, d(x),
                             d(cos), d(sin), d(table), d(qsl), d(lens), d(torch.tensor([8])), None, 0.0, d(y), 1)
    """,
}


@pytest.mark.parametrize("case", CASES)
def test_what_the_checks_refuse_is_a_memory_error(case):
    kernels(ISAS[0])  # built here first: each child then loads it from the cache
    code = SETUP + textwrap.dedent(CASES[case])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "ERROR: AddressSanitizer" in done.stderr, done.stderr[-2000:]
