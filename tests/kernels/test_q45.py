"""kernels/q45.c, llama.cpp's Q5_0 values (w = d * (q - 16)) in `pack_q50`'s layout, Q5_1 values (w = d * q + m) in
`pack_q51`'s and Q5_K and Q4_K values (w = d * sc * q - dmin * m) in `pack_q5k`'s and `pack_q4k`'s: the test's Q5_0
and Q5_1 values against gguf's own dequantization (the k-quants' unpacking: tests/models/test_gguf.py) and what their
packing refuses (the kernels against float64 on every build, their wrappers' checks and the experts' driver reading
them: test_file_blocks.py)."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from latentserve.kernels import native


def q50_values(g: torch.Generator, n: int, k: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """((q, d) as a Q5_0 file holds them, the fp32 weight they stand for, as gguf dequantizes it)."""
    q = torch.randint(0, 32, (n, k), dtype=torch.uint8, generator=g)
    d = (torch.rand(n, k // 32, generator=g) * 1e-2).half()
    return (q, d), d.float().repeat_interleave(32, dim=1) * (q.float() - 16)


def q51_values(g: torch.Generator, n: int, k: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """((q, d, m) as a Q5_1 file holds them, the float64 weight they stand for)."""
    q = torch.randint(0, 32, (n, k), dtype=torch.uint8, generator=g)
    d = (torch.rand(n, k // 32, generator=g) * 1e-2).half()
    m = (-16 * torch.rand(n, k // 32, generator=g) * 1e-2).half()
    per = lambda t: t.double().repeat_interleave(32, dim=1)  # noqa: E731
    return (q, d, m), per(d) * q.double() + per(m)


def _five_bit_blocks(q: torch.Tensor, *head: torch.Tensor) -> np.ndarray:
    """Q5_0 (head: d) or Q5_1 (d, m) rows as a GGUF holds them: per 32 the fp16 head, 4 bytes of fifth bits, 16
    bytes of nibbles."""
    n, k = q.shape
    qb = q.view(n, k // 32, 32).numpy()
    nib = (qb[..., :16] & 15) | ((qb[..., 16:] & 15) << 4)
    high = ((qb >> 4).astype(np.uint32) << np.arange(32, dtype=np.uint32)).sum(-1, dtype=np.uint32)
    fp16 = [t.numpy().reshape(n, -1, 1).view(np.uint8) for t in head]
    return np.concatenate([*fp16, high[..., None].view(np.uint8), nib], axis=-1).reshape(n, -1)


def test_the_test_values_are_ggufs_q5_1():
    (q, d, m), w = q51_values(torch.Generator().manual_seed(0), 8, 128)
    got = torch.from_numpy(dequantize(_five_bit_blocks(q, d, m), GGMLQuantizationType.Q5_1))
    assert torch.equal(got, d.float().repeat_interleave(32, dim=1) * q.float() + m.float().repeat_interleave(32, dim=1))
    torch.testing.assert_close(got.double(), w, rtol=1e-6, atol=0)


def test_pack_q51_refuses_what_is_not_q51():
    q, d, m = q51_values(torch.Generator().manual_seed(0), 16, 128)[0]
    with pytest.raises(ValueError, match=r"pack_q51 takes uint8 q \[N, K\] with K % 64 == 0 and fp16 d and m"):
        native.pack_q51(q[:, :96], d[:, :3], m[:, :3])
    with pytest.raises(ValueError, match=r"pack_q51 takes .* fp16 d and m \[N, K / 32\]"):
        native.pack_q51(q, d, m.float())
    with pytest.raises(ValueError, match=r"pack_q51: q holds 32, past 5 bits' 31"):
        native.pack_q51(q.clone().fill_(32), d, m)


def test_the_test_values_are_ggufs_q5_0():
    (q, d), w = q50_values(torch.Generator().manual_seed(0), 8, 128)
    assert torch.equal(torch.from_numpy(dequantize(_five_bit_blocks(q, d), GGMLQuantizationType.Q5_0)), w)


def test_pack_q50_refuses_what_is_not_q50():
    q, d = q50_values(torch.Generator().manual_seed(0), 16, 128)[0]
    with pytest.raises(ValueError, match=r"pack_q50 takes uint8 q \[N, K\] with K % 64 == 0"):
        native.pack_q50(q[:, :96], d[:, :3])
    with pytest.raises(ValueError, match=r"pack_q50 takes .* fp16 d \[N, K / 32\]"):
        native.pack_q50(q, d.float())
    with pytest.raises(ValueError, match=r"pack_q50: q holds 32, past 5 bits' 31"):
        native.pack_q50(q.clone().fill_(32), d)


def kquant_values(g: torch.Generator, n: int, k: int, bits: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """((q, d, dmin, sc, m) as a Q5_K (bits 5) or Q4_K (4) file holds them, the float64 weight they stand for)."""
    q = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, generator=g)
    d, dmin = ((torch.rand(n, k // 256, generator=g) * 1e-3).half().float() for _ in range(2))
    sc, m = (torch.randint(0, 64, (n, k // 32), dtype=torch.uint8, generator=g) for _ in range(2))
    per = lambda t: t.double().repeat_interleave(8, dim=1).repeat_interleave(32, dim=1)  # noqa: E731
    w = per(d) * sc.double().repeat_interleave(32, dim=1) * q.double() - per(dmin) * m.double().repeat_interleave(
        32, dim=1)
    return (q, d, dmin, sc, m), w


def q5k_values(g: torch.Generator, n: int, k: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    return kquant_values(g, n, k, 5)


def q4k_values(g: torch.Generator, n: int, k: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    return kquant_values(g, n, k, 4)


@pytest.mark.parametrize("bits, pack", [(5, native.pack_q5k), (4, native.pack_q4k)])
def test_pack_kquants_refuse_what_they_do_not_hold(bits, pack):
    q, d, dmin, sc, m = kquant_values(torch.Generator().manual_seed(0), 20, 512, bits)[0]
    fn = pack.__name__
    with pytest.raises(ValueError, match=rf"{fn} takes uint8 q \[N, K\] with K % 256 == 0, fp32 d and dmin"):
        pack(q, d.half(), dmin, sc, m)
    with pytest.raises(ValueError, match=rf"{fn}: q holds {1 << bits}, past {bits} bits' {(1 << bits) - 1}"):
        pack(q.clone().fill_(1 << bits), d, dmin, sc, m)
