"""kernels/q6k.c, llama.cpp's Q6_K values (w = d * sc * (q - 32)) in `pack_q6k`'s layout, Q3_K values (w = d * sc *
(q - 4)) in `pack_q3k`'s and Q2_K values (w = d * sc * q - dmin * m) in `pack_q2k`'s: the test's values (Q3_K's and
Q2_K's against gguf's own dequantization), Q3_K's kernel against Q6_K's on the same values, and what their packing
refuses (the kernel against float64 on every build, its wrappers' checks and the experts' driver reading them:
test_file_blocks.py)."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from latentserve.kernels import native


def _centred_values(g: torch.Generator, n: int, k: int, bits: int, sc_bits: int,
                    d_size: float) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """((q, d, sc), the fp32 weight w = d * sc * (q - centre) they stand for, as gguf dequantizes it) of q of `bits`
    (centre half their range), sc signed of `sc_bits`, an fp16 d below `d_size`."""
    q = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, generator=g)
    d = (torch.rand(n, k // 256, generator=g) * d_size).half().float()  # the file's fp16 d
    sc = torch.randint(-(1 << sc_bits - 1), 1 << sc_bits - 1, (n, k // 16), dtype=torch.int8, generator=g)
    scale = d.repeat_interleave(16, dim=1) * sc.float()  # exact in fp32
    return (q, d, sc), scale.repeat_interleave(16, dim=1) * (q.float() - (1 << bits - 1))


def q6k_values(g: torch.Generator, n: int, k: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """((q, d, sc) as a Q6_K file holds them, the fp32 weight they stand for, as gguf dequantizes it)."""
    return _centred_values(g, n, k, 6, 8, 1e-3)


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


def q2k_values(g: torch.Generator, n: int, k: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """((q, d, dmin, sc, m) as a Q2_K file holds them, the fp32 weight they stand for, as gguf dequantizes it)."""
    q = torch.randint(0, 4, (n, k), dtype=torch.uint8, generator=g)
    d, dmin = ((torch.rand(n, k // 256, generator=g) * 1e-2).half().float() for _ in range(2))  # the file's fp16
    sc, m = (torch.randint(0, 16, (n, k // 16), dtype=torch.uint8, generator=g) for _ in range(2))
    scale = d.repeat_interleave(16, dim=1) * sc.float()  # exact in fp32
    minimum = dmin.repeat_interleave(16, dim=1) * m.float()
    return (q, d, dmin, sc, m), scale.repeat_interleave(16, dim=1) * q.float() - minimum.repeat_interleave(16, dim=1)


def q2k_blocks(q: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, m: torch.Tensor) -> np.ndarray:
    """Q2_K rows as a GGUF holds them: per 256 values 16 bytes sc | m << 4, 64 bytes of bit pairs (each half of 128:
    bits 2j, 2j + 1 of byte i hold value 32j + i), fp16 d, fp16 dmin."""
    n, k = q.shape
    pairs = q.view(n, k // 256, 2, 4, 32).numpy().astype(np.uint8) << (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)
    qs = pairs.sum(axis=3, dtype=np.uint8).reshape(n, k // 256, 64)
    subs = (sc | (m << 4)).view(n, k // 256, 16).numpy()
    heads = [t.half().numpy().reshape(n, -1, 1).view(np.uint8) for t in (d, dmin)]
    return np.concatenate([subs, qs, *heads], axis=-1).reshape(n, -1)


def test_the_test_values_are_ggufs_q2_k():
    values, w = q2k_values(torch.Generator().manual_seed(0), 8, 512)
    got = torch.from_numpy(dequantize(q2k_blocks(*values), GGMLQuantizationType.Q2_K))
    assert torch.equal(got, w)


def test_pack_q2k_refuses_what_is_not_q2k():
    q, d, dmin, sc, m = q2k_values(torch.Generator().manual_seed(0), 16, 256)[0]
    with pytest.raises(ValueError, match=r"pack_q2k takes uint8 q \[N, K\] with K % 256 == 0"):
        native.pack_q2k(q[:, :128], d, dmin, sc[:, :8], m[:, :8])
    with pytest.raises(ValueError, match=r"pack_q2k takes .* uint8 sc and m \[N, K / 16\], not .* torch.int16"):
        native.pack_q2k(q, d, dmin, sc.to(torch.int16), m)
    with pytest.raises(ValueError, match=r"pack_q2k: q holds 4, past Q2_K's 3"):
        native.pack_q2k(q.clone().fill_(4), d, dmin, sc, m)
    with pytest.raises(ValueError, match=r"pack_q2k: m holds 16, past Q2_K's 15"):
        native.pack_q2k(q, d, dmin, sc, m.clone().fill_(16))


def q3k_values(g: torch.Generator, n: int, k: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """((q, d, sc) as a Q3_K file holds them, sc less 32, the fp32 weight they stand for, as gguf dequantizes it)."""
    return _centred_values(g, n, k, 3, 6, 1e-2)


def q3k_blocks(q: torch.Tensor, d: torch.Tensor, sc: torch.Tensor) -> np.ndarray:
    """Q3_K rows as a GGUF holds them: per 256 values 32 bytes of third bits (bit j of byte i: value 32j + i's), 64
    bytes of low bit pairs (each half of 128: bits 2j, 2j + 1 of byte i hold value 32j + i's), 12 bytes of 6-bit
    scales sc + 32 (groups 0-7's low 4 bits in bytes 0-7's low nibbles, 8-15's in their high ones, the top 2 bits of
    group g in bits 2 (g // 4), + 1 of byte 8 + g % 4), fp16 d."""
    n, k = q.shape
    q = q.view(n, k // 256, 256).numpy().astype(np.uint8)
    third = ((q >> 2).reshape(n, -1, 8, 32) << np.arange(8, dtype=np.uint8).reshape(8, 1)).sum(axis=2, dtype=np.uint8)
    pairs = (q & 3).reshape(n, -1, 2, 4, 32) << (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)
    low = pairs.sum(axis=3, dtype=np.uint8).reshape(n, -1, 64)
    six = (sc.numpy().astype(np.int16) + 32).astype(np.uint8).reshape(n, -1, 16)
    nibbles = (six[..., :8] & 15) | ((six[..., 8:] & 15) << 4)
    tops = ((six >> 4).reshape(n, -1, 4, 4) << (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)).sum(
        axis=2, dtype=np.uint8)
    head = d.half().numpy().reshape(n, -1, 1).view(np.uint8)
    return np.concatenate([third, low, nibbles, tops, head], axis=-1).reshape(n, -1)


def test_the_test_values_are_ggufs_q3_k():
    values, w = q3k_values(torch.Generator().manual_seed(0), 8, 512)
    got = torch.from_numpy(dequantize(q3k_blocks(*values), GGMLQuantizationType.Q3_K))
    assert torch.equal(got, w)


def test_pack_q3k_refuses_what_is_not_q3k():
    q, d, sc = q3k_values(torch.Generator().manual_seed(0), 16, 256)[0]
    with pytest.raises(ValueError, match=r"pack_q3k takes uint8 q \[N, K\] with K % 256 == 0"):
        native.pack_q3k(q[:, :128], d, sc[:, :8])
    with pytest.raises(ValueError, match=r"pack_q3k: q holds 8, past Q3_K's 7"):
        native.pack_q3k(q.clone().fill_(8), d, sc)
    with pytest.raises(ValueError, match=r"pack_q3k: sc holds -33 .. 31, past Q3_K's -32 .. 31"):
        native.pack_q3k(q, d, sc.clone().clamp_(-32, 31).index_fill_(1, torch.tensor([0]), -33))
