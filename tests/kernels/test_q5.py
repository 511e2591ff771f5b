"""kernels/q5.c, llama.cpp's Q5_0 values (w = d * (q - 16)) in `pack_q50`'s layout and Q5_K values (w = d * sc * q -
dmin * m) in `pack_q5k`'s: the test's Q5_0 values against gguf's own dequantization (Q5_K's unpacking:
tests/models/test_gguf.py), what the layouts and wrappers refuse, and the experts' driver reading them (their
products against float64 on every build: test_file_blocks.py)."""
import ctypes

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from latentserve.kernels import native
from latentserve.layers.quant.int4 import quantize_int4
from tests.kernels.builds import ISAS, kernels, needs_a_build

pytestmark = needs_a_build


def q50_values(g: torch.Generator, n: int, k: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """((q, d) as a Q5_0 file holds them, the fp32 weight they stand for, as gguf dequantizes it)."""
    q = torch.randint(0, 32, (n, k), dtype=torch.uint8, generator=g)
    d = (torch.rand(n, k // 32, generator=g) * 1e-2).half()
    return (q, d), d.float().repeat_interleave(32, dim=1) * (q.float() - 16)


def q50_blocks(q: torch.Tensor, d: torch.Tensor) -> np.ndarray:
    """The same values as a GGUF's Q5_0 rows (per 32: fp16 d, 4 bytes of fifth bits, 16 bytes of nibbles)."""
    n, k = q.shape
    qb = q.view(n, k // 32, 32).numpy()
    nib = (qb[..., :16] & 15) | ((qb[..., 16:] & 15) << 4)
    high = ((qb >> 4).astype(np.uint32) << np.arange(32, dtype=np.uint32)).sum(-1, dtype=np.uint32)
    return np.concatenate([d.numpy().reshape(n, -1, 1).view(np.uint8), high[..., None].view(np.uint8), nib],
                          axis=-1).reshape(n, -1)


def test_the_test_values_are_ggufs_q5_0():
    (q, d), w = q50_values(torch.Generator().manual_seed(0), 8, 128)
    assert torch.equal(torch.from_numpy(dequantize(q50_blocks(q, d), GGMLQuantizationType.Q5_0)), w)


def test_pack_q50_refuses_what_is_not_q50():
    q, d = q50_values(torch.Generator().manual_seed(0), 16, 128)[0]
    with pytest.raises(ValueError, match=r"pack_q50 takes uint8 q \[N, K\] with K % 64 == 0"):
        native.pack_q50(q[:, :96], d[:, :3])
    with pytest.raises(ValueError, match=r"pack_q50 takes .* fp16 d \[N, K / 32\]"):
        native.pack_q50(q, d.float())
    with pytest.raises(ValueError, match=r"pack_q50: q holds 32, past 5 bits' 31"):
        native.pack_q50(q.clone().fill_(32), d)


def test_q50_linear_checks_what_it_reads():
    k = kernels(ISAS[0])
    packed = native.pack_q50(*q50_values(torch.Generator().manual_seed(0), 20, 512)[0])
    with pytest.raises(ValueError, match=r"q50_linear: the Q5_0 kernel takes K a multiple of 64; got K 480"):
        native.q50_linear(k, torch.randn(1, 480), packed, 20)
    with pytest.raises(ValueError, match=r"q50_linear: packed \(Q5_0 weight of 40 outputs, 512 inputs in pack_q50's "
                                         r"layout\) must be .* \[3, 5632\]; got cpu uint8 \[2, 5632\]"):
        native.q50_linear(k, torch.randn(1, 512), packed, 40)
    # The C entry point refuses on its own: K off the kernel's 64, a weight of fewer blocks than y's outputs.
    d = native.desc
    x, y = torch.randn(1, 512), torch.empty(1, 40)
    assert k.lib.ls_q50_linear(d(torch.randn(1, 480)), d(packed), d(y), 1) == native.abi.BAD_TENSOR
    assert k.lib.ls_q50_linear(d(x), d(packed), d(y), 1) == native.abi.BAD_TENSOR


def _mlp(isa: str, gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor, inter: int, hidden: int):
    """One token through an int4 gate_up and a Q5_0 down, one linear kernel call each."""
    h = native.int4_linear(kernels(isa), x[None], gate_up, 32, 2 * inter)[0]
    a = torch.nn.functional.silu(h[:inter]) * h[inter:]
    return native.q50_linear(kernels(isa), a[None], down, hidden)[0]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_experts_read_q50_down_projections_beside_int4_gate_up(isa, tokens):
    """DeepSeek-V2's experts in a Q4_K_M file: Q4_K gate and up, Q5_0 down over 1408-wide rows (not a multiple of
    256); each token's weighted sum of its experts, as the linear kernels give each expert, a few tokens and many."""
    g = torch.Generator().manual_seed(tokens)
    hidden, inter, count = 256, 192, 4
    pairs = [(native.pack_int4(*quantize_int4(torch.randn(2 * inter, hidden, generator=g) * 0.2, 32)),
              native.pack_q50(*q50_values(g, hidden, inter)[0])) for _ in range(count)]
    table = native.expert_table(pairs, hidden, inter, ((4, 32), native.Q50_FORMAT))
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.stack([torch.randperm(count, generator=g)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=g)
    got = native.experts(kernels(isa), x, table, ids, weights)
    for t in range(tokens):
        want = sum(weights[t, j] * _mlp(isa, *pairs[e], x[t], inter, hidden)
                   for j, e in sorted(enumerate(ids[t].tolist()), key=lambda p: p[1]))
        torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_expert_tables_check_q50_weights():
    gate_up = native.pack_int4(*quantize_int4(torch.randn(384, 256), 32))
    down = native.pack_q50(*q50_values(torch.Generator().manual_seed(0), 256, 192)[0])
    with pytest.raises(ValueError, match=r"expert_table: experts\[0\].down \(Q5_0 weight of 256 outputs, 192 inputs "
                                         r"in pack_q50's layout\) must be .* \[16, 2112\]; got cpu uint8 \[32, 2112\]"):
        native.expert_table([(gate_up, torch.cat([down, down]))], 256, 192, ((4, 32), native.Q50_FORMAT))
    table = native.expert_table([(gate_up, down)], 256, 192, ((4, 32), native.Q50_FORMAT))
    table.table.group[1] = 16  # what the C side checks on its own: Q5_0's group is 32
    code = kernels(ISAS[0]).lib.ls_experts(ctypes.byref(table.table), None, native.desc(torch.randn(1, 256)),
                                           native.desc(torch.zeros(1, 1).long()), native.desc(torch.ones(1, 1)),
                                           native.desc(torch.empty(1, 256)), 1)
    assert code == native.abi.BAD_TENSOR


def q5k_values(g: torch.Generator, n: int, k: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """((q, d, dmin, sc, m) as a Q5_K file holds them, the float64 weight they stand for)."""
    q = torch.randint(0, 32, (n, k), dtype=torch.uint8, generator=g)
    d, dmin = ((torch.rand(n, k // 256, generator=g) * 1e-3).half().float() for _ in range(2))
    sc, m = (torch.randint(0, 64, (n, k // 32), dtype=torch.uint8, generator=g) for _ in range(2))
    per = lambda t: t.double().repeat_interleave(8, dim=1).repeat_interleave(32, dim=1)  # noqa: E731
    w = per(d) * sc.double().repeat_interleave(32, dim=1) * q.double() - per(dmin) * m.double().repeat_interleave(
        32, dim=1)
    return (q, d, dmin, sc, m), w


def test_pack_q5k_and_q5k_linear_refuse_what_they_cannot_read():
    values = q5k_values(torch.Generator().manual_seed(0), 20, 512)[0]
    q, d, dmin, sc, m = values
    with pytest.raises(ValueError, match=r"pack_q5k takes uint8 q \[N, K\] with K % 256 == 0, fp32 d and dmin"):
        native.pack_q5k(q, d.half(), dmin, sc, m)
    with pytest.raises(ValueError, match=r"pack_q5k: q holds 32, past 5 bits' 31"):
        native.pack_q5k(q.clone().fill_(32), d, dmin, sc, m)
    k = kernels(ISAS[0])
    packed = native.pack_q5k(*values)
    with pytest.raises(ValueError, match=r"q5k_linear: the Q5_K kernel takes K a multiple of 256; got K 448"):
        native.q5k_linear(k, torch.randn(1, 448), packed, 20)
    with pytest.raises(ValueError, match=r"q5k_linear: packed \(Q5_K weight of 40 outputs, 512 inputs in pack_q5k's "
                                         r"layout\) must be .* \[3, 5888\]; got cpu uint8 \[2, 5888\]"):
        native.q5k_linear(k, torch.randn(1, 512), packed, 40)
    d_ = native.desc
    assert k.lib.ls_q5k_linear(d_(torch.randn(1, 448)), d_(packed), d_(torch.empty(1, 20)), 1) == native.abi.BAD_TENSOR
    assert k.lib.ls_q5k_linear(d_(torch.randn(1, 512)), d_(packed), d_(torch.empty(1, 40)), 1) == native.abi.BAD_TENSOR


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_experts_read_q5k_weights(isa, tokens):
    """A Q5_K_M file's MoE: Q5_K gate, up and down; each token's weighted sum of its experts, as the linear kernels
    give each expert, a few tokens and many."""
    g = torch.Generator().manual_seed(tokens)
    hidden, inter, count = 256, 256, 4
    pairs = [(native.pack_q5k(*q5k_values(g, 2 * inter, hidden)[0]), native.pack_q5k(*q5k_values(g, hidden, inter)[0]))
             for _ in range(count)]
    table = native.expert_table(pairs, hidden, inter, (native.Q5K_FORMAT, native.Q5K_FORMAT))
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.stack([torch.randperm(count, generator=g)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=g)
    got = native.experts(kernels(isa), x, table, ids, weights)
    for t in range(tokens):
        want = 0
        for j, e in sorted(enumerate(ids[t].tolist()), key=lambda p: p[1]):
            h = native.q5k_linear(kernels(isa), x[t][None], pairs[e][0], 2 * inter)[0]
            a = torch.nn.functional.silu(h[:inter]) * h[inter:]
            want = want + weights[t, j] * native.q5k_linear(kernels(isa), a[None], pairs[e][1], hidden)[0]
        torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
