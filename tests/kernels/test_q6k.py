"""kernels/q6k.c, llama.cpp's Q6_K values (w = d * sc * (q - 32)) in `pack_q6k`'s layout: what its layout and
wrappers refuse, and the experts' driver reading it (its products against float64 on every build:
test_file_blocks.py)."""
import ctypes

import pytest
import torch

from latentserve.kernels import native
from latentserve.layers.quant.int4 import quantize_int4
from tests.kernels.builds import ISAS, kernels, needs_a_build

pytestmark = needs_a_build


def q6k_values(g: torch.Generator, n: int, k: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """((q, d, sc) as a Q6_K file holds them, the fp32 weight they stand for, as gguf dequantizes it)."""
    q = torch.randint(0, 64, (n, k), dtype=torch.uint8, generator=g)
    d = (torch.rand(n, k // 256, generator=g) * 1e-3).half().float()  # the file's fp16 d
    sc = torch.randint(-128, 128, (n, k // 16), dtype=torch.int8, generator=g)
    scale = d.repeat_interleave(16, dim=1) * sc.float()  # exact in fp32
    return (q, d, sc), scale.repeat_interleave(16, dim=1) * (q.float() - 32)


def exact_x(g: torch.Generator, m: int, k: int) -> torch.Tensor:
    """Integers whose every 64 columns reach 127: their int8 quantization is exact, so the kernel's products are too."""
    x = torch.randint(-127, 128, (m, k), generator=g).float()
    x[:, ::64] = 127
    return x


def test_pack_q6k_refuses_what_is_not_q6k():
    q, d, sc = q6k_values(torch.Generator().manual_seed(0), 16, 256)[0]
    with pytest.raises(ValueError, match=r"pack_q6k takes uint8 q \[N, K\] with K % 256 == 0"):
        native.pack_q6k(q[:, :128], d, sc[:, :8])
    with pytest.raises(ValueError, match=r"pack_q6k takes .* int8 sc \[N, K / 16\]"):
        native.pack_q6k(q, d, sc.to(torch.int16))
    with pytest.raises(ValueError, match=r"pack_q6k: q holds 64, past Q6_K's 63"):
        native.pack_q6k(q.clone().fill_(64), d, sc)


def test_q6k_linear_checks_what_it_reads():
    k = kernels(ISAS[0])
    packed = native.pack_q6k(*q6k_values(torch.Generator().manual_seed(0), 20, 512)[0])
    with pytest.raises(ValueError, match=r"q6k_linear: the Q6_K kernel takes K a multiple of 256; got K 500"):
        native.q6k_linear(k, torch.randn(1, 500), packed, 20)
    with pytest.raises(ValueError, match=r"q6k_linear: packed \(Q6_K weight of 40 outputs, 512 inputs in pack_q6k's "
                                         r"layout\) must be .* \[3, 6784\]; got cpu uint8 \[2, 6784\]"):
        native.q6k_linear(k, torch.randn(1, 512), packed, 40)
    # The C entry point refuses on its own: K off the super-blocks, a weight of fewer blocks than y's outputs.
    d = native.desc
    x, y = torch.randn(1, 512), torch.empty(1, 40)
    assert k.lib.ls_q6k_linear(d(torch.randn(1, 500)), d(packed), d(y), 1) == native.abi.BAD_TENSOR
    assert k.lib.ls_q6k_linear(d(x), d(packed), d(y), 1) == native.abi.BAD_TENSOR


def _mlp(isa: str, gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor, inter: int, hidden: int):
    """One token through an int4 gate_up and a Q6_K down, one linear kernel call each."""
    h = native.int4_linear(kernels(isa), x[None], gate_up, 64, 2 * inter)[0]
    a = torch.nn.functional.silu(h[:inter]) * h[inter:]
    return native.q6k_linear(kernels(isa), a[None], down, hidden)[0]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_experts_read_q6k_down_projections_beside_int4_gate_up(isa, tokens):
    """A Q4_K_M file's MoE: Q4_K gate and up, Q6_K down; each token's weighted sum of its experts, as the linear
    kernels give each expert (the driver quantizes the activations as they do), a few tokens and many (pairs of
    blocks, waves)."""
    g = torch.Generator().manual_seed(tokens)
    hidden, inter, count = 256, 256, 4
    pairs = [(native.pack_int4(*quantize_int4(torch.randn(2 * inter, hidden, generator=g) * 0.2, 64)),
              native.pack_q6k(*q6k_values(g, hidden, inter)[0])) for _ in range(count)]
    table = native.expert_table(pairs, hidden, inter, ((4, 64), native.Q6K_FORMAT))
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.stack([torch.randperm(count, generator=g)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=g)
    got = native.experts(kernels(isa), x, table, ids, weights)
    for t in range(tokens):
        want = sum(weights[t, j] * _mlp(isa, *pairs[e], x[t], inter, hidden)
                   for j, e in sorted(enumerate(ids[t].tolist()), key=lambda p: p[1]))
        torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_expert_tables_check_q6k_weights():
    gate_up = native.pack_int4(*quantize_int4(torch.randn(512, 256), 64))
    down = native.pack_q6k(*q6k_values(torch.Generator().manual_seed(0), 256, 256)[0])
    with pytest.raises(ValueError, match=r"expert_table: experts\[0\].down \(Q6_K weight of 256 outputs, 256 inputs "
                                         r"in pack_q6k's layout\) must be .* \[16, 3392\]; got cpu uint8 \[32, 3392\]"):
        native.expert_table([(gate_up, torch.cat([down, down]))], 256, 256, ((4, 64), native.Q6K_FORMAT))
    table = native.expert_table([(gate_up, down)], 256, 256, ((4, 64), native.Q6K_FORMAT))
    table.table.group[1] = 32  # what the C side checks on its own: Q6_K's group is 16
    code = kernels(ISAS[0]).lib.ls_experts(ctypes.byref(table.table), None, native.desc(torch.randn(1, 256)),
                                           native.desc(torch.zeros(1, 1).long()), native.desc(torch.ones(1, 1)),
                                           native.desc(torch.empty(1, 256)), 1)
    assert code == native.abi.BAD_TENSOR
