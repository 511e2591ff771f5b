"""kernels/q6k.c, llama.cpp's Q6_K values (w = d * sc * (q - 32)) in `pack_q6k`'s layout: the test's values, and what
its packing refuses (its kernel against float64 on every build, its wrappers' checks and the experts' driver
reading it: test_file_blocks.py)."""

import pytest
import torch

from latentserve.kernels import native


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
