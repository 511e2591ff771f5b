"""kernels/experts.c, the experts' one driver for every weight format, against each token's experts computed one
projection at a time (float64 for dense weights; the quantized linears' own kernels for int8 and int4, which
quantize the activations as the driver does), for each build this machine runs."""
import ctypes

import pytest
import torch
import torch.nn.functional as F

from latentserve.kernels import native
from latentserve.layers.quant.int4 import quantize_int4
from latentserve.layers.quant.int8 import quantize_int8
from tests.kernels.builds import ISAS, kernels, needs_a_build

pytestmark = needs_a_build

FORMATS = {"fp32": (32, 0), "bf16": (16, 0), "int8": (8, 0), "int4": (4, 64)}


def _weight(g: torch.Generator, fmt: str, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the weight as the driver reads it, the fp32 rows it stands for)."""
    w = torch.randn(n, k, generator=g) * 0.2
    if fmt in ("fp32", "bf16"):
        stored = w.to(torch.bfloat16 if fmt == "bf16" else torch.float32)
        return stored, stored.float()
    if fmt == "int8":
        return native.pack_int8(*quantize_int8(w)), w
    return native.pack_int4(*quantize_int4(w, 64)), w


def _project(isa: str, fmt: str, stored: torch.Tensor, x: torch.Tensor, n: int) -> torch.Tensor:
    """x [1, K] (fp32) times one projection, in float64: exact for dense weights, the linear kernels' for quantized."""
    if fmt in ("fp32", "bf16"):
        return x.double() @ stored.double().t()
    if fmt == "int8":
        return native.int8_linear(kernels(isa), x, stored, n).double()
    return native.int4_linear(kernels(isa), x, stored, 64, n).double()


def _experts(g, formats: tuple[str, str], count: int, hidden: int, inter: int):
    weights = [(_weight(g, formats[0], 2 * inter, hidden), _weight(g, formats[1], hidden, inter)) for _ in range(count)]
    table = native.expert_table([(gu[0], d[0]) for gu, d in weights], hidden, inter,
                                (FORMATS[formats[0]], FORMATS[formats[1]]))
    return table, [(gu[0], d[0]) for gu, d in weights]


def _mlp(isa: str, formats: tuple[str, str], pair, x: torch.Tensor, inter: int) -> torch.Tensor:
    h = _project(isa, formats[0], pair[0], x.float()[None], 2 * inter)[0]
    a = (F.silu(h[:inter].float()) * h[inter:].float())[None]
    return _project(isa, formats[1], pair[1], a, x.shape[0])[0]


def _at_thread_counts(call) -> list[torch.Tensor]:
    """call()'s results at 1, 2 and 3 threads."""
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(call())
        return results
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("formats, shared_formats, dtype", [
    (("fp32", "fp32"), ("fp32", "fp32"), torch.float32),
    (("bf16", "bf16"), ("bf16", "bf16"), torch.bfloat16),
    (("bf16", "bf16"), ("bf16", "bf16"), torch.float32),  # bf16 weights, fp32 activations: no vdpbf16ps
    (("int4", "int8"), ("int8", "int8"), torch.float32),  # a Q4_K_M file: 8-bit down projections beside 4-bit gate_up
    (("int8", "int4"), ("fp32", "fp32"), torch.bfloat16),  # quantized routed experts, a dense shared MLP
])
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_experts_are_each_tokens_weighted_sum_of_gated_mlps(isa, formats, shared_formats, dtype, tokens):
    """Each token through 3 of 5 experts in id order, weighted, rounded; plus the shared MLP (twice as wide, its own
    formats), rounded, the two added as torch adds them."""
    g = torch.Generator().manual_seed(tokens)
    hidden, inter = 128, 64
    routed, pairs = _experts(g, formats, 5, hidden, inter)
    shared, shared_pair = _experts(g, shared_formats, 1, hidden, 2 * inter)
    x = (torch.randn(tokens, hidden, generator=g) * 2).to(dtype)
    ids = torch.tensor([[4, 0, 2], [1, 2, 3], [0, 4, 1]] + [torch.randperm(5, generator=g)[:3].tolist()
                                                          for _ in range(5)])[:tokens]
    weights = torch.rand(tokens, 3, generator=g)
    k = kernels(isa)
    got = native.experts(k, x, routed, ids, weights, shared)
    alone = native.experts(k, x, routed, ids, weights)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    expected = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for e, w in sorted(zip(ids[t].tolist(), weights[t].tolist())):
            expected[t] += w * _mlp(isa, formats, pairs[e], x[t], inter)
    tol = 1e-4 if dtype == torch.float32 and "bf16" not in formats and "int4" not in formats else 2e-2
    torch.testing.assert_close(alone.double(), expected, rtol=tol, atol=tol * expected.abs().max().item())
    shared_alone = torch.stack([_mlp(isa, shared_formats, shared_pair[0], x[t], 2 * inter) for t in range(tokens)])
    torch.testing.assert_close(got.double(), expected + shared_alone, rtol=tol,
                               atol=tol * (expected + shared_alone).abs().max().item())
    # The routed sum and the shared MLP each rounded to y's dtype, then added: torch's rounding, to the bit.
    only_shared = native.experts(k, x, shared, torch.zeros(tokens, 1, dtype=torch.int64), torch.ones(tokens, 1))
    assert torch.equal(got, (alone.float() + only_shared.float()).to(dtype))
    # A token's result does not depend on the others in the call, nor on the order of its ids.
    last = native.experts(k, x[-1:].contiguous(), routed, ids[-1:].flip(1), weights[-1:].flip(1), shared)
    assert torch.equal(last[0], got[-1])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("formats", [("fp32", "fp32"), ("bf16", "bf16"), ("int4", "int8")])
def test_experts_do_not_depend_on_the_thread_count(isa, formats):
    """Each output is one thread's dot product and each sum one thread's: 1, 2 or 3 threads, the same bits, with
    a width whose last block of 16 rows is short (dense: 2 * 40 and 72 rows)."""
    g = torch.Generator().manual_seed(3)
    dense = formats[0] in ("fp32", "bf16")
    hidden, inter = (72, 40) if dense else (128, 64)
    routed, _ = _experts(g, formats, 4, hidden, inter)
    shared, _ = _experts(g, formats, 1, hidden, 2 * inter)
    dtype = torch.bfloat16 if "bf16" in formats else torch.float32
    x = (torch.randn(3, hidden, generator=g) * 2).to(dtype)
    ids, weights = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(3)]), torch.rand(3, 2, generator=g)
    results = _at_thread_counts(lambda: native.experts(kernels(isa), x, routed, ids, weights, shared))
    assert all(torch.equal(results[0], r) for r in results[1:])


@pytest.mark.skipif(len(ISAS) < 2, reason="needs two builds")
@pytest.mark.parametrize("formats", [("int8", "int8"), ("int4", "int4"), ("int4", "int8")])
def test_every_build_gives_the_quantized_experts_the_same_bits(formats):
    """The quantized linears' products are the same on every build (test_quant_native.py), and so is what the
    driver does around them: a few tokens (pairs of blocks) and many (the experts in waves), bf16 and fp32 x."""
    g = torch.Generator().manual_seed(4)
    routed, _ = _experts(g, formats, 6, 128, 64)
    shared, _ = _experts(g, formats, 1, 128, 128)
    for tokens, dtype in ((1, torch.float32), (5, torch.bfloat16), (40, torch.float32), (40, torch.bfloat16)):
        x = torch.randn(tokens, 128, generator=g).to(dtype)
        ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(tokens)])
        weights = torch.rand(tokens, 2, generator=g)
        want = native.experts(kernels("avx2"), x, routed, ids, weights, shared)
        for isa in ISAS:
            assert torch.equal(native.experts(kernels(isa), x, routed, ids, weights, shared), want), (isa, tokens)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("ids", [[[1, 4]], [[0, 1], [2, 3]], [[0, 1], [2, 3], [0, 2]], [[0, 1], [0, 2], [0, 3]]])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_experts_read_in_pairs_use_each_blocks_own_rows(isa, ids, fmt):
    """int8 and int4 read two blocks at once, from the two halves of a thread's share: blocks of different experts,
    met by different tokens (ids [[0, 1], [2, 3]] at 1 thread: expert 0 beside expert 2), or by the same count of
    different tokens ([[0, 1], [2, 3], [0, 2]]: experts 0 and 2 each meet two), or by different counts ([[0, 1],
    [0, 2], [0, 3]]: expert 0 meets three tokens beside experts that meet one; the pair reads one row of each, then
    expert 0's other two alone). At 1-3 threads each token's result is its experts' own, projection by projection."""
    g = torch.Generator().manual_seed(len(ids))
    hidden, inter = 128, 64
    routed, pairs = _experts(g, (fmt, fmt), 5, hidden, inter)
    shared, shared_pair = _experts(g, (fmt, fmt), 1, hidden, 2 * inter)
    tokens, ids = len(ids), torch.tensor(ids)
    x, weights = torch.randn(tokens, hidden, generator=g) * 2, torch.rand(tokens, 2, generator=g)
    expected = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for e, w in sorted(zip(ids[t].tolist(), weights[t].tolist())):
            expected[t] += w * _mlp(isa, (fmt, fmt), pairs[e], x[t], inter)
        expected[t] += _mlp(isa, (fmt, fmt), shared_pair[0], x[t], 2 * inter)
    results = _at_thread_counts(lambda: native.experts(kernels(isa), x, routed, ids, weights, shared))
    torch.testing.assert_close(results[0].double(), expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_experts_refuse_what_they_cannot_read():
    g = torch.Generator().manual_seed(0)
    k = kernels(ISAS[0])
    routed, pairs = _experts(g, ("fp32", "fp32"), 2, 16, 8)
    x, ids, weights = torch.randn(1, 16), torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1)
    with pytest.raises(ValueError, match=r"experts: the table holds experts 0..1, got ids \[\[2\]\]"):
        native.experts(k, x, routed, ids + 2, weights)  # never read past the table
    with pytest.raises(ValueError, match="ids must be a CPU tensor, contiguous int64"):
        native.experts(k, x, routed, ids.int(), weights)
    with pytest.raises(ValueError, match=r"x must be a CPU tensor, contiguous float32 or bfloat16 \[\*, 16\]"):
        native.experts(k, torch.randn(1, 24), routed, ids, weights)
    with pytest.raises(ValueError, match="the shared experts must be one expert of hidden size 16; got 2 of 16"):
        native.experts(k, x, routed, ids, weights, routed)
    with pytest.raises(ValueError, match=r"expert_table: experts\[1\].down must be .* float32 \[16, 8\]; got cpu "
                                         r"bfloat16 \[16, 8\]"):
        native.expert_table([pairs[0], (pairs[1][0], pairs[1][1].bfloat16())], 16, 8, ((32, 0), (32, 0)))
    with pytest.raises(ValueError, match=r"expert_table takes .* got 2 experts, formats \(\(32, 0\), \(3, 0\)\)"):
        native.expert_table(pairs, 16, 8, ((32, 0), (3, 0)))


def test_the_experts_entry_point_names_a_table_it_cannot_read():
    """A caller that skips the wrappers (kernels/native/): the C side checks the tables itself and names what is wrong."""
    g = torch.Generator().manual_seed(0)
    lib = kernels(ISAS[0]).lib
    routed, _ = _experts(g, ("fp32", "fp32"), 2, 16, 8)
    x, ids, weights, y = torch.randn(1, 16), torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1), torch.empty(1, 16)
    descs = [native.desc(t) for t in (x, ids, weights, y)]
    pointers = (ctypes.c_void_p * 4)(*routed.held[0])
    pointers[3] = None
    broken = native.ExpertTable(2, 8, routed.table.bits, routed.table.mins, routed.table.group,
                                ctypes.addressof(pointers))
    assert lib.ls_experts(ctypes.byref(broken), None, *descs, 1) == native.abi.BAD_TENSOR
    assert lib.ls_last_error() == b"routed: weights[3] is NULL"
    two = native.ExpertTable(2, 8, routed.table.bits, routed.table.mins, routed.table.group, routed.table.weights)
    assert lib.ls_experts(ctypes.byref(routed.table), ctypes.byref(two), *descs, 1) == native.abi.BAD_TENSOR
    assert lib.ls_last_error() == b"shared: 2 experts, not 0 or 1"
    assert lib.ls_experts(ctypes.byref(routed.table), None, *descs, 1) == native.abi.OK


@pytest.mark.parametrize("isa", ISAS)
def test_many_tokens_sharing_few_experts_each_get_their_own_result(isa):
    """40 tokens over 3 experts (batch-invariant mode sends a whole prefill): each expert's group holds many pairs,
    and each token's result is still what it is alone."""
    g = torch.Generator().manual_seed(5)
    routed, _ = _experts(g, ("bf16", "bf16"), 3, 64, 48)
    x = torch.randn(40, 64, generator=g).bfloat16()
    ids, weights = torch.stack([torch.randperm(3, generator=g)[:2] for _ in range(40)]), torch.rand(40, 2, generator=g)
    got = native.experts(kernels(isa), x, routed, ids, weights)
    for t in (0, 17, 39):
        alone = native.experts(kernels(isa), x[t : t + 1].contiguous(), routed, ids[t : t + 1], weights[t : t + 1])
        assert torch.equal(alone[0], got[t])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("formats", [("int4", "int8"), ("int8", "int8")])
def test_a_prefills_shared_and_routed_experts_read_one_quantized_x(isa, formats):
    """40 tokens (past the row count at which x is quantized on every thread), routed and shared experts of one
    format (x quantized once for both): at 1, 2 and 3 threads the same bits, and each token's result the one it gets
    alone (x quantized on the calling thread)."""
    g = torch.Generator().manual_seed(11)
    hidden, inter = 128, 64
    routed, _ = _experts(g, formats, 4, hidden, inter)
    shared, _ = _experts(g, formats, 1, hidden, 2 * inter)
    x = torch.randn(40, hidden, generator=g) * 2
    ids, weights = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(40)]), torch.rand(40, 2, generator=g)
    results = _at_thread_counts(lambda: native.experts(kernels(isa), x, routed, ids, weights, shared))
    assert all(torch.equal(results[0], r) for r in results[1:])
    for t in (0, 21, 39):
        alone = native.experts(kernels(isa), x[t : t + 1], routed, ids[t : t + 1], weights[t : t + 1], shared)
        assert torch.equal(alone[0], results[0][t])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("formats, dtype", [(("int8", "int8"), torch.bfloat16), (("int4", "int8"), torch.float32),
                                            (("bf16", "bf16"), torch.bfloat16)])
def test_a_long_prefill_runs_in_waves_each_token_as_alone(isa, formats, dtype):
    """300 tokens, top-3 of 5 experts and the shared MLP: 1200 pairs, past the 256 a wave holds, expert 3 chosen by
    every token (300 rows: two groups) and the shared MLP's 300 rows split too. Each token's result is what it gets
    alone, to the bit, at 1-3 threads, and its experts' weighted sum projection by projection (float64)."""
    g = torch.Generator().manual_seed(13)
    hidden, inter, tokens = 128, 64, 300
    routed, pairs = _experts(g, formats, 5, hidden, inter)
    shared, shared_pair = _experts(g, formats, 1, hidden, 2 * inter)
    x = (torch.randn(tokens, hidden, generator=g) * 2).to(dtype)
    others = torch.stack([torch.tensor([0, 1, 2, 4])[torch.randperm(4, generator=g)[:2]] for _ in range(tokens)])
    ids, weights = torch.cat([torch.full((tokens, 1), 3), others], 1), torch.rand(tokens, 3, generator=g)
    results = _at_thread_counts(lambda: native.experts(kernels(isa), x, routed, ids, weights, shared))
    assert all(torch.equal(results[0], r) for r in results[1:])
    got = results[0]
    for t in range(tokens):
        alone = native.experts(kernels(isa), x[t : t + 1].contiguous(), routed, ids[t : t + 1], weights[t : t + 1],
                               shared)
        assert torch.equal(alone[0], got[t]), t
    for t in (0, 150, 299):
        expected = _mlp(isa, formats, shared_pair[0], x[t], 2 * inter)
        for e, w in sorted(zip(ids[t].tolist(), weights[t].tolist())):
            expected += w * _mlp(isa, formats, pairs[e], x[t], inter)
        torch.testing.assert_close(got[t].double(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
