"""Numerics the kernels owe their callers, for each build this machine runs: NaNs stay NaNs (int8 activations, bf16
rounding), int8 weights of -128 multiply right on AVX2, int8 sums stay exact at their largest, and stacked experts do
not depend on the thread count."""
from __future__ import annotations

import pytest
import torch

from latentserve.kernels import native
from latentserve.layers.quant.int4 import quantize_int4
from latentserve.layers.quant.int8 import quantize_int8
from tests.kernels.builds import ISAS, kernels, needs_a_build

pytestmark = needs_a_build


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_int8_activations_keep_a_nan_row_nan(isa, bad):
    """vmax and fmaxf drop NaN: the row's scale came out finite and NaN quantized to 0, a finite result where
    torch's int8 path gives NaN."""
    g = torch.Generator().manual_seed(0)
    q, scale = quantize_int8(torch.randn(24, 100, generator=g))
    x = torch.randn(3, 100, generator=g)
    x[1, 37] = bad  # column 37: in a vector; 99: in the scalar tail
    x[2, 99] = bad
    got = native.int8_linear(kernels(isa), x, native.pack_int8(q, scale), 24)
    assert got[1:].isnan().all() and not got[0].isnan().any()
    torch.testing.assert_close(got[0], native.int8_linear(kernels(isa), x[:1], native.pack_int8(q, scale), 24)[0])


@pytest.mark.parametrize("isa", ISAS)
def test_int4_activations_keep_a_nan_row_nan(isa):
    g = torch.Generator().manual_seed(1)
    q, scale, minimum = quantize_int4(torch.randn(16, 128, generator=g), 64)
    x = torch.randn(2, 128, generator=g)
    x[1, 5] = float("nan")
    got = native.int4_linear(kernels(isa), x, native.pack_int4(q, scale, minimum), 64, 16)
    assert got[1].isnan().all() and not got[0].isnan().any()


@pytest.mark.parametrize("isa", ISAS)
def test_int8_weights_of_minus_128_multiply_right(isa):
    """AVX2's vpsignb negated a -128 weight to -128 (off by 256 |x| a product); the quantizer here never writes
    -128, a checkpoint's int8 weights may."""
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-128, 128, (32, 96), dtype=torch.int8, generator=g)
    q[:, :40] = -128
    scale = torch.rand(32, generator=g) + 0.5
    qsum = q.sum(dim=1, dtype=torch.int32)
    x = torch.randn(3, 96, generator=g)
    xs = x.abs().amax(dim=1, keepdim=True) / 127
    expected = (torch.div(x, xs).round().double() @ q.double().t()) * xs.double() * scale.double()
    got = native.int8_linear(kernels(isa), x, native.pack_int8(q, scale), 32)
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-5)
    lanes = native.int8_heads_lanes(kernels(isa), x[:, None], native.int8_lanes(q[None]), scale, qsum)[:, 0]
    torch.testing.assert_close(lanes.double(), expected, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [3, 12])
def test_int8_sums_are_exact_at_their_largest(isa, rows):
    """AVX2 adds 8 steps of nibble products in int16 before widening them (qgemm.c): the largest, weights of -128
    against x of 127 (both nibbles 15), reach 8 * 3840 of 32767. Long rows (many steps, then a tail of 36 columns),
    in every layout: the linear's blocks (3 rows: two blocks at once), the per-head rows and lanes."""
    g = torch.Generator().manual_seed(3)
    k = 2048 + 36
    q = torch.full((16, k), -128, dtype=torch.int8)
    q[8:, 1::2] = 127
    scale = torch.rand(16, generator=g) + 0.5
    x = torch.full((rows, k), 1.0)
    x[1, ::3] = -1.0  # x of -127: both nibbles at their smallest beside the largest
    x[2:] = torch.randn(rows - 2, k, generator=g)
    xs = x.abs().amax(dim=1, keepdim=True) / 127
    expected = (torch.div(x, xs).round().double() @ q.double().t()) * xs.double() * scale.double()
    got = native.int8_linear(kernels(isa), x, native.pack_int8(q, scale), 16)
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=0)
    qsum = q.sum(dim=1, dtype=torch.int32)
    heads = native.int8_heads(kernels(isa), x[:, None], q[None], scale, qsum)[:, 0]
    lanes = native.int8_heads_lanes(kernels(isa), x[:, None], native.int8_lanes(q[None]), scale, qsum)[:, 0]
    torch.testing.assert_close(heads.double(), expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(lanes.double(), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_rounding_keeps_nan_a_nan(isa):
    """0x7fffffff rounded to nearest even carried into the sign bit: -0.0."""
    x = torch.ones(1, 32)
    x[0, 3] = torch.tensor(0x7FFFFFFF, dtype=torch.int32).view(torch.float32)
    got = native.dense_linear(kernels(isa), x, torch.ones(4, 32), torch.bfloat16)
    assert got.isnan().all()
