"""The kernels of llama.cpp's formats kept as their blocks (Q6_K, Q3_K, Q2_K: q6k.c; Q5_0, Q5_1, Q5_K, Q4_K: q45.c),
each through its linear entry point on every build this machine runs: the exact product of the file's values where x's
int8 quantization is exact, any x within int8's error, the same bits on every build, and each row's result whatever the
thread count and the rows beside it; and the experts' driver reading them as the linear entry point does."""
import ctypes
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from latentserve.kernels import native
from latentserve.layers.quant.int4 import quantize_int4
from tests.kernels.builds import ISAS, kernels, needs_a_build
from tests.kernels.test_q45 import q4k_values, q5k_values, q50_values, q51_values
from tests.kernels.test_q6k import exact_x, q2k_values, q3k_values, q6k_values

pytestmark = needs_a_build


@dataclass(frozen=True)
class Blocks:
    values: Callable  # (generator, n, k) -> (the file's values, the weight they stand for)
    pack: Callable
    linear: Callable
    k: int  # a K the format takes; shapes below use multiples of it
    format: tuple[int, int]  # the experts' (bits, group)


FORMATS = {"Q6_K": Blocks(q6k_values, native.pack_q6k, native.q6k_linear, 256, native.Q6K_FORMAT),
           "Q3_K": Blocks(q3k_values, native.pack_q3k, native.q3k_linear, 256, native.Q3K_FORMAT),
           "Q2_K": Blocks(q2k_values, native.pack_q2k, native.q2k_linear, 256, native.Q2K_FORMAT),
           "Q5_0": Blocks(q50_values, native.pack_q50, native.q50_linear, 64, native.Q50_FORMAT),
           "Q5_1": Blocks(q51_values, native.pack_q51, native.q51_linear, 64, native.Q51_FORMAT),
           "Q5_K": Blocks(q5k_values, native.pack_q5k, native.q5k_linear, 256, native.Q5K_FORMAT),
           "Q4_K": Blocks(q4k_values, native.pack_q4k, native.q4k_linear, 256, native.Q4K_FORMAT)}


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


@pytest.mark.parametrize("file_type", FORMATS)
def test_the_linear_wrapper_and_entry_point_check_what_they_read(file_type):
    f = FORMATS[file_type]
    k, fn, layout = kernels(ISAS[0]), f.linear.__name__, f.pack.__name__
    packed = f.pack(*f.values(torch.Generator().manual_seed(0), 20, 512)[0])
    with pytest.raises(ValueError, match=rf"{fn}: the {file_type} kernel takes K a multiple of {f.k}; got K 480"):
        f.linear(k, torch.randn(1, 480), packed, 20)
    with pytest.raises(ValueError, match=rf"{fn}: packed \({file_type} weight of 40 outputs, 512 inputs in {layout}'s "
                                         rf"layout\) must be .* \[3, {packed.shape[1]}\]; got cpu uint8 \[2, "
                                         rf"{packed.shape[1]}\]"):
        f.linear(k, torch.randn(1, 512), packed, 40)
    # The C entry point refuses on its own: K off the kernel's multiple, a weight of fewer blocks than y's outputs.
    d, entry = native.desc, getattr(k.lib, f"ls_{fn}")
    assert entry(d(torch.randn(1, 480)), d(packed), d(torch.empty(1, 20)), 1) == native.abi.BAD_TENSOR
    assert entry(d(torch.randn(1, 512)), d(packed), d(torch.empty(1, 40)), 1) == native.abi.BAD_TENSOR


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


@pytest.mark.parametrize("isa", ISAS)
def test_q3k_gives_the_bits_of_its_values_as_q6k(isa):
    """Q3_K's w = d * sc * (q - 4) is Q6_K's with q + 28: its own layout and unpacking, Q6_K's arithmetic, the same bits
    at every row count (AMX tiles from 32 rows, read-ahead from 3, pairs of blocks at few)."""
    g = torch.Generator().manual_seed(4)
    (q, d, sc), _ = q3k_values(g, 70, 1024)
    three, six = native.pack_q3k(q, d, sc), native.pack_q6k(q + 28, d, sc)
    assert three.numel() / six.numel() == 3.625 / 6.625
    for m in (1, 2, 3, 8, 40, 64):
        x = torch.randn(m, 1024, generator=g)
        got = native.q3k_linear(kernels(isa), x, three, 70)
        assert torch.equal(got, native.q6k_linear(kernels(isa), x, six, 70)), m


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


def _experts(g: torch.Generator, f: Blocks, own_gate_up: bool, hidden: int, inter: int, count: int):
    """`count` experts whose down is in f's format and gate_up in int4 groups of 32 (a Q4_K_M file's) or f's own."""
    def gate_up():
        if own_gate_up:
            return f.pack(*f.values(g, 2 * inter, hidden)[0])
        return native.pack_int4(*quantize_int4(torch.randn(2 * inter, hidden, generator=g) * 0.2, 32))
    return [(gate_up(), f.pack(*f.values(g, hidden, inter)[0])) for _ in range(count)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("file_type, own_gate_up", [("Q6_K", False), ("Q3_K", False), ("Q3_K", True), ("Q2_K", True),
                                                   ("Q5_0", False), ("Q5_1", False), ("Q5_1", True), ("Q5_K", True),
                                                   ("Q4_K", True)])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_experts_read_the_format_as_the_linear_kernel(isa, file_type, own_gate_up, tokens):
    """A quantized file's MoE: the down projections in the format (Q5_0 over V2's 1408-wide rows, not a multiple of 256)
    beside Q4_K gate and up, or gate and up in it too (Q5_K_M); each token's weighted sum of its experts, as the linear
    kernels give each expert (the driver quantizes the activations as they do), a few tokens and many."""
    f = FORMATS[file_type]
    g = torch.Generator().manual_seed(tokens)
    hidden, inter, count = 256, 192 if f.k == 64 else 256, 4
    pairs = _experts(g, f, own_gate_up, hidden, inter, count)
    table = native.expert_table(pairs, hidden, inter, (f.format if own_gate_up else (4, 32), f.format))
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.stack([torch.randperm(count, generator=g)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=g)
    got = native.experts(kernels(isa), x, table, ids, weights)
    for t in range(tokens):
        want = 0
        for j, e in sorted(enumerate(ids[t].tolist()), key=lambda p: p[1]):
            gate_up = (f.linear(kernels(isa), x[t][None], pairs[e][0], 2 * inter) if own_gate_up else
                       native.int4_linear(kernels(isa), x[t][None], pairs[e][0], 32, 2 * inter))[0]
            a = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            want = want + weights[t, j] * f.linear(kernels(isa), a[None], pairs[e][1], hidden)[0]
        torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("file_type", FORMATS)
def test_expert_tables_check_the_formats_weights(file_type):
    f = FORMATS[file_type]
    (gate_up, down), = _experts(torch.Generator().manual_seed(0), f, False, 256, 256, 1)
    with pytest.raises(ValueError, match=rf"expert_table: experts\[0\].down \({file_type} weight of 256 outputs, 256 "
                                         rf"inputs in pack_\w+'s layout\) must be .* \[16, {down.shape[1]}\]; got cpu "
                                         rf"uint8 \[32, {down.shape[1]}\]"):
        native.expert_table([(gate_up, torch.cat([down, down]))], 256, 256, ((4, 32), f.format))
    table = native.expert_table([(gate_up, down)], 256, 256, ((4, 32), f.format))
    # What the C side checks on its own: each format's group, and mins (Q5_1's) only on 5 bits in groups of 32.
    faults = [("group", 8)] + ([] if f.format[:2] == (5, 32) else [("mins", 1)])
    for field, value in faults:
        saved = getattr(table.table, field)[1]
        getattr(table.table, field)[1] = value
        code = kernels(ISAS[0]).lib.ls_experts(ctypes.byref(table.table), None, native.desc(torch.randn(1, 256)),
                                               native.desc(torch.zeros(1, 1).long()), native.desc(torch.ones(1, 1)),
                                               native.desc(torch.empty(1, 256)), 1)
        getattr(table.table, field)[1] = saved
        assert code == native.abi.BAD_TENSOR, field
