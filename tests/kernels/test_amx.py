"""The avx512_amx build (kernels/amx.c, amx_blocks.c): its int8, int4, Q6_K, Q3_K, Q2_K, Q5_0, Q5_1, Q5_K and Q4_K
products at many rows run on AMX tiles and must equal the avx512_bf16 build's (vpdpbusd) to the bit, through the linears
and the experts, at row counts 16 does not divide, input widths 64 does not divide (int8), every int4 group size and 1
or 2 threads; and the build is chosen only where the CPU has AMX, and refused with the reason where the tiles cannot be
had."""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from latentserve.kernels import build, native
from latentserve.kernels.cpu import cpu_features
from latentserve.layers.quant.int4 import quantize_int4
from latentserve.layers.quant.int8 import quantize_int8
from tests.kernels.builds import ISAS, kernels
from tests.kernels.test_file_blocks import FORMATS

needs_amx = pytest.mark.skipif("avx512_amx" not in ISAS,
                               reason="no AMX here (CPU without amx_tile, AVX512-BF16 or VNNI, or ATEN_CPU_CAPABILITY)")
ROWS = (16, 17, 31, 64, 256, 300)  # int8 runs on the tiles from 16 rows
INT4_ROWS = (16, 17, 31, 32, 33, 300)  # int4 from 16 at groups of 64 and 128, from 32 at group 32
# llama.cpp's formats kept as blocks: on the tiles from 32 rows
FILE_FORMATS = ("Q6_K", "Q3_K", "Q2_K", "Q5_0", "Q5_1", "Q5_K", "Q4_K")
FILE_ROWS = (31, 32, 47, 64, 300)  # their whole 16s on tiles, the rest on the vector kernel


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's bits as integers: NaNs compare equal where their bits are."""
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@needs_amx
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("k", [36, 256, 260, 1408])  # 260: a tail of 4 columns after the tiles' 256; 36: all tail
@pytest.mark.parametrize("m", ROWS)
def test_int8_linear_equals_the_vnni_build_bit_for_bit(m, k, threads):
    g = torch.Generator().manual_seed(m * 7 + k)
    n = 40  # two blocks and a short one
    q, scale = quantize_int8(torch.randn(n, k, generator=g) * 0.1)
    q[3, : k // 2] = -128  # a checkpoint's weights may hold -128; the quantizer here never writes it
    packed = native.pack_int8(q, scale)
    x = torch.randn(m, k, generator=g) * 3
    x[m // 2, 5] = float("nan")  # a row holding a NaN comes out NaN, on the tiles too
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        got = native.int8_linear(kernels("avx512_amx"), xd, packed, n, dtype)
        want = native.int8_linear(kernels("avx512_bf16"), xd, packed, n, dtype)
        assert torch.equal(_bits(got), _bits(want))
    assert got[m // 2].isnan().all() and not got[: m // 2].isnan().any()


@needs_amx
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("k", [384, 2304])  # 2304: past the 2048 columns the tiles unpack at a time
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", INT4_ROWS)
def test_int4_linear_equals_the_vnni_build_bit_for_bit(m, group, k, threads):
    g = torch.Generator().manual_seed(m * 5 + group + k)
    n = 33
    packed = native.pack_int4(*quantize_int4(torch.randn(n, k, generator=g) * 0.1, group))
    x = torch.randn(m, k, generator=g) * 3
    x[m - 1, 200] = float("nan")
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        got = native.int4_linear(kernels("avx512_amx"), xd, packed, group, n, dtype)
        want = native.int4_linear(kernels("avx512_bf16"), xd, packed, group, n, dtype)
        assert torch.equal(_bits(got), _bits(want))
    assert got[m - 1].isnan().all() and not got[: m - 1].isnan().any()


@needs_amx
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("k", [512, 2304])  # 2304: past the 2048 columns the tiles unpack at a time
@pytest.mark.parametrize("file_type", FILE_FORMATS)
@pytest.mark.parametrize("m", FILE_ROWS)
def test_file_blocks_linear_equals_the_vnni_build_bit_for_bit(m, file_type, k, threads):
    f = FORMATS[file_type]
    g = torch.Generator().manual_seed(m * 3 + k)
    n = 40
    values, w = f.values(g, n, k)
    packed = f.pack(*values)
    x = torch.randn(m, k, generator=g) * 3
    x[m // 2, 100] = float("nan")  # on a tile from 32 rows
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        got = f.linear(kernels("avx512_amx"), xd, packed, n, dtype)
        want = f.linear(kernels("avx512_bf16"), xd, packed, n, dtype)
        assert torch.equal(_bits(got), _bits(want))
    others = torch.arange(m) != m // 2
    assert got[m // 2].isnan().all() and not got[others].isnan().any()
    # and the value: x times the file's weights, within the activations' int8 rounding
    expected = x[others].double() @ w.double().T
    torch.testing.assert_close(got[others].double(), expected, rtol=0, atol=0.02 * expected.abs().max().item())


@needs_amx
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_linears_on_tiles_match_float64_math(fmt):
    """Against x times the dequantized weight in float64: only the activations' rounding to int8 between them."""
    g = torch.Generator().manual_seed(11)
    m, n, k = 100, 48, 512
    w, x = torch.randn(n, k, generator=g) * 0.1, torch.randn(m, k, generator=g)
    if fmt == "int8":
        q, scale = quantize_int8(w)
        dequantized = q.double() * scale.double()[:, None]
        got = native.int8_linear(kernels("avx512_amx"), x, native.pack_int8(q, scale), n)
    else:
        q, scale, minimum = quantize_int4(w, 64)
        dequantized = (q.double().view(n, -1, 64) * scale.double()[..., None] + minimum.double()[..., None]).view(n, k)
        got = native.int4_linear(kernels("avx512_amx"), x, native.pack_int4(q, scale, minimum), 64, n)
    expected = x.double() @ dequantized.t()
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=0.02 * expected.abs().max().item())


def _table(g: torch.Generator, fmt: str, count: int, hidden: int, inter: int) -> native.Experts:
    def stored(rows: int, cols: int) -> torch.Tensor:
        w = torch.randn(rows, cols, generator=g) * 0.1
        return native.pack_int8(*quantize_int8(w)) if fmt == "int8" else native.pack_int4(*quantize_int4(w, 32))
    formats = ((8, 0), (8, 0)) if fmt == "int8" else ((4, 32), (4, 32))
    weights = [(stored(2 * inter, hidden), stored(hidden, inter)) for _ in range(count)]
    return native.expert_table(weights, hidden, inter, formats)


@needs_amx
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_experts_at_prefill_equal_the_vnni_build(fmt, threads):
    """ls_experts at prefill sizes: 200 tokens, 2 of 6 experts each (groups of ~67 rows on the tiles), the shared
    experts meeting all 200; one expert chosen by 9 tokens only (under 16 rows: the vpdpbusd path)."""
    g = torch.Generator().manual_seed(5)
    hidden, inter, tokens = 256, 64, 200
    routed, shared = _table(g, fmt, 7, hidden, inter), _table(g, fmt, 1, hidden, 2 * inter)
    ids = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(tokens)])
    ids[:9, 0] = 6
    weights = torch.rand(tokens, 2, generator=g)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    got = native.experts(kernels("avx512_amx"), x, routed, ids, weights, shared)
    want = native.experts(kernels("avx512_bf16"), x, routed, ids, weights, shared)
    assert torch.equal(_bits(got), _bits(want))


@needs_amx
@pytest.mark.parametrize("file_type", FILE_FORMATS)
def test_file_blocks_experts_at_prefill_equal_the_vnni_build(file_type):
    """A file's MoE at prefill, gate_up and down in the format (Q5_0's rows 1408 / 64 wide as V2's downs are not a
    multiple of 256), 120 tokens, 2 of 4 experts each: groups of ~60 rows on the tiles."""
    f = FORMATS[file_type]
    g = torch.Generator().manual_seed(7)
    hidden, inter, tokens, count = 256, 192 if f.k == 64 else 256, 120, 4
    pairs = [(f.pack(*f.values(g, 2 * inter, hidden)[0]), f.pack(*f.values(g, hidden, inter)[0]))
             for _ in range(count)]
    table = native.expert_table(pairs, hidden, inter, (f.format, f.format))
    ids = torch.stack([torch.randperm(count, generator=g)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=g)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    got = native.experts(kernels("avx512_amx"), x, table, ids, weights)
    want = native.experts(kernels("avx512_bf16"), x, table, ids, weights)
    assert torch.equal(_bits(got), _bits(want))


def test_the_amx_build_is_chosen_only_with_amx(monkeypatch):
    monkeypatch.delenv(native.NATIVE_ENV, raising=False)  # the choice by the CPU, not the developer's setting
    here = dataclasses.replace(cpu_features(), capability="AVX512", vnni=True, avx512_bf16=True, amx=True,
                               avx_vnni=False)
    assert native.kernel_isa(here)[0] == "avx512_amx"
    assert native.kernel_isa(dataclasses.replace(here, amx=False))[0] == "avx512_bf16"
    assert native.kernel_isa(dataclasses.replace(here, avx512_bf16=False))[0] == "avx512_vnni"
    assert native.kernel_isa(dataclasses.replace(here, capability="AVX2"))[0] == "avx2"  # ATEN_CPU_CAPABILITY=avx2
    amx = native.NativeKernels("avx512_amx", None)
    assert amx.bf16_dot and amx.layout == "avx512_bf16"  # a superset of avx512_bf16, its weights packed alike


def test_an_amx_build_without_the_tiles_falls_back_with_the_reason(monkeypatch, caplog):
    """Where ls_enable_amx fails (here: a library without AMX code standing in), the build is refused with a
    WARNING naming why, and avx512_bf16 runs."""
    others = [isa for isa in ISAS if isa != "avx512_amx"]
    if not others:
        pytest.skip("no build of latentserve's kernels runs here")
    stand_in = kernels(others[0])
    assert stand_in.lib.ls_enable_amx() == native.abi.NO_AMX
    monkeypatch.setattr(build, "_build", lambda isa: stand_in.lib._name)
    monkeypatch.setattr(build, "_open", lambda path: stand_in.lib)
    with caplog.at_level(logging.WARNING, logger=build.log.name):
        why = build.load.__wrapped__("avx512_amx")
    assert isinstance(why, str) and "this build has no AMX code" in why
    assert "refusing the avx512_amx build" in caplog.text
    fallback = object()
    monkeypatch.delenv(native.NATIVE_ENV, raising=False)
    monkeypatch.setattr(build, "load", lambda isa: why if isa == "avx512_amx" else fallback)
    here = dataclasses.replace(cpu_features(), capability="AVX512", vnni=True, avx512_bf16=True, amx=True)
    built, reason = native.native_kernels(here)
    assert built is fallback and "avx512_amx build unavailable (no AMX in this process" in reason
