"""The kernels of llama.cpp's formats kept as their blocks (Q6_K: q6k.c; Q5_0, Q5_K: q5.c), each through its linear
entry point on every build this machine runs: the exact product of the file's values where x's int8 quantization is
exact, any x within int8's error, the same bits on every build, and each row's result whatever the thread count and
the rows beside it."""
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from latentserve.kernels import native
from tests.kernels.builds import ISAS, kernels, needs_a_build
from tests.kernels.test_q5 import q5k_values, q50_values
from tests.kernels.test_q6k import exact_x, q6k_values

pytestmark = needs_a_build


@dataclass(frozen=True)
class Blocks:
    values: Callable  # (generator, n, k) -> (the file's values, the weight they stand for)
    pack: Callable
    linear: Callable
    k: int  # a K the format takes; shapes below use multiples of it


FORMATS = {"Q6_K": Blocks(q6k_values, native.pack_q6k, native.q6k_linear, 256),
           "Q5_0": Blocks(q50_values, native.pack_q50, native.q50_linear, 64),
           "Q5_K": Blocks(q5k_values, native.pack_q5k, native.q5k_linear, 256)}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("file_type", FORMATS)
@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 23])
@pytest.mark.parametrize("n, blocks", [(16, 1), (40, 22), (3, 3)])
def test_the_exact_product_of_the_files_values(isa, file_type, m, n, blocks):
    """With x whose int8 quantization is exact, only the fp32 sums' rounding (Q5_K: the minimum's part meets the
    exact sums of x)."""
    f = FORMATS[file_type]
    k = f.k * blocks if f.k == 64 else f.k * min(blocks, 4)
    g = torch.Generator().manual_seed(m * 1000 + n)
    values, w = f.values(g, n, k)
    x = exact_x(g, m, k)
    want = x.double() @ w.double().T
    got = f.linear(kernels(isa), x, f.pack(*values), n)
    bound = (x.double().abs() @ w.double().abs().T).max().item() * 1e-6
    torch.testing.assert_close(got.double(), want, rtol=0, atol=bound)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("file_type", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_activations_are_quantized_as_int4_does(isa, file_type, dtype):
    """Any x: quantized to int8 per 64 columns, as the int4 kernel quantizes it."""
    f = FORMATS[file_type]
    g = torch.Generator().manual_seed(1)
    values, w = f.values(g, 48, 512)
    x = torch.randn(6, 512, generator=g).to(dtype)
    got = f.linear(kernels(isa), x, f.pack(*values), 48, dtype)
    assert got.dtype == dtype
    want = x.double() @ w.double().T
    error = (got.double() - want).abs().max() / want.abs().max()
    assert error < (2e-2 if dtype == torch.bfloat16 else 1e-2)


@pytest.mark.skipif(len(ISAS) < 2, reason="needs two builds")
@pytest.mark.parametrize("file_type", FORMATS)
def test_every_build_gives_the_same_bits(file_type):
    f = FORMATS[file_type]
    g = torch.Generator().manual_seed(2)
    k = 1408 if f.k == 64 else 1024
    values, _ = f.values(g, 70, k)
    packed = f.pack(*values)
    for m in (1, 3, 8, 40):
        x = torch.randn(m, k, generator=g)
        want = f.linear(kernels("avx2"), x, packed, 70)
        for isa in ISAS:
            assert torch.equal(f.linear(kernels(isa), x, packed, 70), want), (isa, m)


@pytest.mark.parametrize("file_type", FORMATS)
def test_a_row_does_not_depend_on_the_thread_count_or_the_other_rows(file_type):
    f = FORMATS[file_type]
    g = torch.Generator().manual_seed(3)
    values, _ = f.values(g, 300, 512)
    packed, x = f.pack(*values), torch.randn(9, 512, generator=g)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(f.linear(kernels(ISAS[0]), x, packed, 300))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], r) for r in results[1:])
    for row in (0, 4, 8):  # alone (one row: two blocks at once) as among the nine
        assert torch.equal(f.linear(kernels(ISAS[0]), x[row:row + 1], packed, 300)[0], results[0][row])
