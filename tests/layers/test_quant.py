"""Weight formats against naive fp32 references: DeepSeek FP8 block dequantization, int8 and int4 kernels."""
from __future__ import annotations

import dataclasses
import os
import platform
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from latentserve.layers.quant import linear as quant_linear
from latentserve.layers.quant.config import Fp8Config, QuantConfig, int4_group, resolve_quantization
from latentserve.kernels.cpu import CpuFeatures, cpu_features
from latentserve.kernels.policy import KernelPolicy, default_policy
from latentserve.layers.quant.fp8 import dequantize_block_fp8
from latentserve.layers.quant.int4 import (
    INT4_DEQUANT_ROWS,
    Int4Linear,
    Int4PackLinear,
    NativeInt4Linear,
    dequantize_int4,
    int4pack_block_n,
    quantize_int4,
)
from latentserve.layers.quant.int8 import Int8Linear, IntMMInt8Linear, NativeInt8Linear, quantize_int8, quantize_rows
from latentserve.layers.quant.linear import blocks_kernel, quantize_linear
from latentserve.layers.quant.prequantized import Q2KWeight, Q3KWeight, Q4KWeight, Q6KWeight, Q50Weight
from latentserve.layers.quant.q45 import NativeQ4KLinear, NativeQ5KLinear, NativeQ50Linear, NativeQ51Linear
from latentserve.layers.quant.q6k import NativeQ2KLinear, NativeQ3KLinear, NativeQ6KLinear
from latentserve.kernels.native import NATIVE_ENV, native_kernels
from latentserve.models.formats.gguf_weights import (q2k_weight, q3k_weight, q4k_weight, q5k_weight, q6k_weight,
                                                     q50_weight, q51_weight)
from tests.models.gguf_checkpoint import k_quant_blocks

FP8 = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[128, 128])


def _naive_block_dequant(w: torch.Tensor, scale_inv: torch.Tensor, bo: int, bi: int) -> torch.Tensor:
    out = torch.empty(w.shape)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            block = w[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi].float()
            out[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi] = block * scale_inv[i, j].item()
    return out


def test_fp8_dequantization_is_the_published_one_with_partial_edge_blocks():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(300, 200, generator=g) * 100).to(torch.float8_e4m3fn)  # 3 x 2 blocks, the last ones partial
    scale_inv = torch.rand(3, 2, generator=g) + 0.01
    got = dequantize_block_fp8(w, scale_inv, (128, 128))
    assert torch.equal(got, _naive_block_dequant(w, scale_inv, 128, 128))
    with pytest.raises(ValueError, match=r"layer.weight_scale_inv has shape \(2, 2\).*needs \(3, 2\)"):
        dequantize_block_fp8(w, scale_inv[:2], (128, 128), "layer.weight")


@pytest.mark.parametrize("field, value, match", [
    ("quant_method", "awq", r"field 'quant_method' is 'awq'; supported: \['fp8'\]"),
    ("fmt", "e5m2", r"field 'fmt' is 'e5m2'; supported: \['e4m3'\]"),
    ("activation_scheme", "static", r"field 'activation_scheme' is 'static'; supported: \['dynamic'\]"),
    ("weight_block_size", [128], r"field 'weight_block_size' must be two positive ints"),
    ("weight_block_size", [128, 0], r"field 'weight_block_size' must be two positive ints"),
])
def test_fp8_config_names_the_unsupported_field(field, value, match):
    assert Fp8Config.from_dict(FP8) == Fp8Config((128, 128))
    with pytest.raises(ValueError, match=match):
        Fp8Config.from_dict({**FP8, field: value})


def test_quantization_options_resolve_or_say_why_not():
    fp8 = Fp8Config()
    assert resolve_quantization(None, None, fp8) is None and resolve_quantization("fp8", None, fp8) is None
    # re-quantizes the dequantized FP8; lm_head too unless told not to
    assert resolve_quantization("int8", None, fp8) == QuantConfig("int8", lm_head=True)
    assert resolve_quantization("int4", None, None, False) == QuantConfig("int4", None, lm_head=False)
    assert resolve_quantization("int4", 64, None, False) == QuantConfig("int4", 64, lm_head=False)
    with pytest.raises(ValueError, match="lm_head_quantized applies to quantization='int8' or 'int4' only"):
        resolve_quantization(None, None, None, False)
    with pytest.raises(ValueError, match="lm_head_quantized must be True, False or None, got 'yes'"):
        resolve_quantization("int8", None, None, "yes")
    with pytest.raises(ValueError, match="quantization='fp8' needs a DeepSeek FP8 checkpoint"):
        resolve_quantization("fp8", None, None)
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        resolve_quantization("int3", None, None)
    with pytest.raises(ValueError, match=r"quantization_group_size must be one of \(32, 64, 128\), got 48"):
        resolve_quantization("int4", 48, None)
    with pytest.raises(ValueError, match="applies to int4 only"):
        resolve_quantization("int8", 64, None)


def test_int4_group_per_layer():
    """No group size asked: each layer its largest that divides its input; one asked: that one or a named error."""
    auto, g64 = QuantConfig("int4"), QuantConfig("int4", 64)
    assert [int4_group(auto, "x", n) for n in (2048, 1408, 10944, 96)] == [128, 128, 64, 32]
    assert int4_group(g64, "x", 2048) == 64
    with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj: int4 needs input columns in multiples of 32"):
        int4_group(auto, "model.layers.0.mlp.down_proj", 100)
    with pytest.raises(ValueError, match="down_proj: int4 group size 128 does not divide its 10944 input columns"):
        int4_group(QuantConfig("int4", 128), "down_proj", 10944)


def _layer(out_features: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(out_features, in_features, generator=g), torch.randn(out_features, generator=g),
            torch.randn(5, in_features, generator=g))


def test_int8_quantization_error_is_half_a_step():
    w, _, _ = _layer(64, 96)
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() == 127
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-6).all()


def test_rows_are_quantized_symmetric_half_to_even_and_a_non_finite_row_is_nan():
    x = torch.tensor([[127.0, 0.5, -1.5, 2.5, -127.0], [0.0, 0.0, 0.0, 0.0, 0.0], [1.0, float("inf"), 0.0, 0.0, 0.0],
                      [1.0, float("nan"), 0.0, 0.0, 0.0]])
    xq, scale = quantize_rows(x.to(torch.bfloat16))
    assert xq.dtype == torch.int8 and scale.shape == (4, 1)
    assert xq[0].tolist() == [127, 0, -2, 2, -127] and scale[0, 0] == 1.0  # halves to even
    assert xq[1].tolist() == [0] * 5 and scale[1, 0] == torch.tensor(1e-12) / 127
    assert (xq[2:] == 0).all() and scale[2:].isnan().all()


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="oneDNN's x86 int8 paths")
def test_without_vnni_int_mm_takes_the_weight_in_two_parts_and_stays_exact():
    """oneDNN without VNNI (forced by ONEDNN_MAX_CPU_ISA, read at its first call: a fresh process) saturates
    `_int_mm`'s sums; the layer then splits the weight and its outputs are the exact sums' as ever."""
    script = (
        "import torch\n"
        "from latentserve.layers.quant.int8 import IntMMInt8Linear, int_mm_parts, quantize_int8, quantize_rows\n"
        "g = torch.Generator().manual_seed(0)\n"
        "a = torch.full((1, 256), 127, dtype=torch.int8)\n"
        "assert torch._int_mm(a, a.t()).item() != 127 * 127 * 256  # the saturation itself\n"
        "assert int_mm_parts() == 2\n"
        "q, scale = quantize_int8(torch.randn(40, 256, generator=g))\n"
        "q[0] = 127; q[1] = -127\n"
        "x = torch.randn(9, 256, generator=g); x[0] = 1.0\n"
        "layer = IntMMInt8Linear(q, scale, None)\n"
        "assert layer.qweight.shape == (2, 40, 256)\n"
        "xq, xs = quantize_rows(x)\n"
        "exact = (xq.long() @ q.long().t()).float() * xs * scale\n"
        "assert torch.equal(layer(x), exact), (layer(x) - exact).abs().max()\n"
    )
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("rows", [1, 5])
def test_int_mm_int8_is_exact_integer_sums_of_per_row_quantized_activations(rows):
    """An fp64 reference of the same arithmetic: each row quantized on its own (so a row's result does not depend on
    the others), products of the integers summed exactly, scaled by both scales."""
    w, bias, x = _layer(64, 96)
    x = x[:rows] * torch.linspace(0.01, 100, rows)[:, None]  # rows of very different ranges
    q, scale = quantize_int8(w)
    layer = IntMMInt8Linear(q, scale, torch.nn.Parameter(bias))
    scale_x = x.abs().amax(dim=1, keepdim=True) / 127
    xq = (x / scale_x).round()
    expected = (xq.double() @ q.double().t()) * scale_x.double() * scale.double() + bias.double()
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(layer(x[-1:]), layer(x)[-1:])  # a row's result is its own
    assert layer(x.to(torch.bfloat16)).dtype == torch.bfloat16
    assert IntMMInt8Linear(q, scale, None, torch.float32)(x.to(torch.bfloat16)).dtype == torch.float32
    with pytest.raises(ValueError, match="x has 48 columns, the layer takes 96"):
        layer(torch.randn(4, 48))  # as many values as 2 rows of 96: a reshape alone would take them


def test_int8_fallback_matches_the_dequantized_weight():
    w, bias, x = _layer(40, 96)
    q, scale = quantize_int8(w)
    layer = Int8Linear(q, scale, torch.nn.Parameter(bias))
    torch.testing.assert_close(layer(x), x @ (q.float() * scale[:, None]).t() + bias, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int4_quantization_error_is_half_a_step(group_size):
    w, _, _ = _layer(32, 256)
    q, scale, minimum = quantize_int4(w, group_size)
    assert q.max() <= 15 and scale.shape == (32, 256 // group_size)
    err = (dequantize_int4(q, scale, minimum) - w).abs().view(32, -1, group_size)
    assert (err <= scale[..., None] / 2 + 1e-6).all()


@pytest.mark.parametrize("group_size", [32, 128])
def test_int4pack_matches_the_dequantized_weight(group_size):
    w, bias, x = _layer(48, 256)
    q, scale, minimum = quantize_int4(w, group_size)
    expected = x @ dequantize_int4(q, scale, minimum).t() + bias
    exact = Int4PackLinear(q, scale, minimum, torch.nn.Parameter(bias), torch.float32)
    torch.testing.assert_close(exact(x), expected, rtol=1e-4, atol=1e-4)
    # bf16 activations, scales and zeros, bf16 out: bf16 round-off on top.
    fast = Int4PackLinear(q, scale, minimum, torch.nn.Parameter(bias), torch.bfloat16)
    torch.testing.assert_close(fast(x), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


def test_int4_fallback_matches_the_dequantized_weight():
    w, bias, x = _layer(40, 64)
    q, scale, minimum = quantize_int4(w, 32)
    layer = Int4Linear(q, scale, minimum, torch.nn.Parameter(bias))
    assert layer.qweight.shape == (40, 32)  # two weights a byte
    torch.testing.assert_close(layer(x), x @ dequantize_int4(q, scale, minimum).t() + bias, rtol=1e-5, atol=1e-5)
    no_bias = Int4Linear(q, scale, minimum, None)
    full = no_bias(x)
    torch.testing.assert_close(no_bias(x.bfloat16()).float(), full, rtol=2e-2, atol=2e-2 * full.abs().max().item())


def _policy(features: CpuFeatures, kernels: bool = True) -> KernelPolicy:
    """The policy of a CPU with `features`, with the kernels that build for it (or none)."""
    built, why = native_kernels(features) if kernels else (None, "test")
    return KernelPolicy(features, built, why, 1)


def test_kernels_are_chosen_by_the_policy(monkeypatch):
    monkeypatch.delenv(NATIVE_ENV, raising=False)  # an AVX2 CPU is simulated below: no developer's build named
    w, _, _ = _layer(48, 64)
    here = _policy(cpu_features())
    int8 = quantize_linear("l", w, None, QuantConfig("int8"), "cpu", here)
    int4 = quantize_linear("l", w, None, QuantConfig("int4", 32), "cpu", here)
    if here.kernels is not None:
        assert isinstance(int8, NativeInt8Linear) and isinstance(int4, NativeInt4Linear)
        assert int8.kernels is here.kernels and int4.kernels is here.kernels
        w96 = torch.randn(48, 96)  # latentserve's int4 kernel takes inputs in multiples of 64
        assert isinstance(quantize_linear("l", w96, None, QuantConfig("int4", 32), "cpu", here), Int4PackLinear)
        avx2 = _policy(dataclasses.replace(here.features, capability="AVX2", avx_vnni=False))
        int8 = quantize_linear("l", w, None, QuantConfig("int8"), "cpu", avx2)
        assert isinstance(int8, NativeInt8Linear) and int8.kernels.isa == "avx2"
        int4 = quantize_linear("l", w, None, QuantConfig("int4", 32), "cpu", avx2)
        assert isinstance(int4, NativeInt4Linear) and int4.kernels.isa == "avx2"
    torch_only = _policy(here.features, kernels=False)  # PyTorch's kernels
    int8 = quantize_linear("l", w, None, QuantConfig("int8"), "cpu", torch_only)
    assert isinstance(int8, IntMMInt8Linear)
    assert isinstance(quantize_linear("l", w, None, QuantConfig("int4", 32), "cpu", torch_only), Int4PackLinear)
    assert isinstance(quantize_linear("l", w[:40], None, QuantConfig("int4", 32), "cpu", torch_only),
                      Int4Linear)  # 40 % 16
    avx2 = _policy(dataclasses.replace(here.features, capability="AVX2"), kernels=False)
    assert isinstance(quantize_linear("l", w, None, QuantConfig("int8"), "cpu", avx2), IntMMInt8Linear)
    int4 = quantize_linear("l", w, None, QuantConfig("int4", 32), "cpu", avx2)
    assert isinstance(int4, Int4PackLinear) and int4.compute_dtype == torch.bfloat16
    assert int4.gemm_dtype == torch.float32  # its many-row GEMM: bf16 is emulated on AVX2
    with pytest.raises(ValueError, match="model.layers.3.mlp.down_proj: int4 group size 128 does not divide its 64"):
        quantize_linear("model.layers.3.mlp.down_proj", w, None, QuantConfig("int4", 128), "cpu", here)


def test_without_a_policy_quantize_linear_takes_the_default_one(monkeypatch):
    w, _, _ = _layer(48, 64)
    monkeypatch.setenv(NATIVE_ENV, "0")  # the default policy then has no kernels
    assert default_policy().kernels is None
    assert type(quantize_linear("l", w, None, QuantConfig("int8"), "cpu")) is IntMMInt8Linear


def _runs_on_the_kernels(weight, layer_type: type, x: torch.Tensor, expected: torch.Tensor) -> KernelPolicy | None:
    """Where latentserve's kernels build here: the weight loads as `layer_type` on them and gives `expected` within
    int8 activations' error, bf16 in and out too; the policy (None where they do not build)."""
    here = _policy(cpu_features())
    if here.kernels is None:
        return None
    layer = quantize_linear("l", weight, None, QuantConfig("int4", 32), "cpu", here)
    assert isinstance(layer, layer_type) and layer.kernels is here.kernels
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=2e-2 * expected.abs().max().item())
    assert layer(x.bfloat16()).dtype == torch.bfloat16
    return here


def test_a_gguf_q6k_weight_runs_latentserves_q6k_kernel_or_int8_per_row(monkeypatch):
    """Q6_K's blocks as they are where latentserve's kernels run; elsewhere its values quantized to int8 per row, as
    before that kernel; lm_head's logits in fp32 either way."""
    monkeypatch.delenv(NATIVE_ENV, raising=False)
    weight = q6k_weight(k_quant_blocks((48, 512), GGMLQuantizationType.Q6_K, np.random.default_rng(0)))
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1))
    expected = x @ weight.dequantize().t()
    int4 = QuantConfig("int4", 32)  # the load's configuration does not matter: the weight has its own format
    torch_only = _policy(cpu_features(), kernels=False)
    layer = quantize_linear("l", weight, None, int4, "cpu", torch_only)
    q, scale = quantize_int8(weight.dequantize())
    assert isinstance(layer, IntMMInt8Linear) and torch.equal(layer.scale, scale)
    assert torch.equal(IntMMInt8Linear(q, scale, None).qweight, layer.qweight)
    assert quantize_linear("lm_head", weight, None, int4, "cpu", torch_only).out_dtype == torch.float32
    here = _runs_on_the_kernels(weight, NativeQ6KLinear, x, expected)
    if here is None:
        return
    head = quantize_linear("lm_head", weight, None, int4, "cpu", here)
    assert isinstance(head, NativeQ6KLinear) and head(x.bfloat16()).dtype == torch.float32


# The 16-column k-quants beside Q6_K: the unpacking, the weight's type, its layer.
SIXTEEN_COLUMN = {"Q2_K": (q2k_weight, Q2KWeight, NativeQ2KLinear), "Q3_K": (q3k_weight, Q3KWeight, NativeQ3KLinear)}


@pytest.mark.parametrize("file_type", SIXTEEN_COLUMN)
def test_a_gguf_q2k_or_q3k_weight_runs_its_kernel_or_int8_per_row(monkeypatch, file_type):
    """Q2_K's and Q3_K's blocks as they are where latentserve's kernels run and the inputs are a multiple of 256;
    elsewhere their values quantized to int8 per row."""
    monkeypatch.delenv(NATIVE_ENV, raising=False)
    unpack, kind, layer_type = SIXTEEN_COLUMN[file_type]
    weight = unpack(k_quant_blocks((48, 512), GGMLQuantizationType[file_type], np.random.default_rng(0)))
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1))
    expected = x @ weight.dequantize().t()
    layer = quantize_linear("l", weight, None, QuantConfig("int4", 32), "cpu", _policy(cpu_features(), kernels=False))
    assert isinstance(layer, IntMMInt8Linear) and torch.equal(layer.scale, quantize_int8(weight.dequantize())[1])
    here = _runs_on_the_kernels(weight, layer_type, x, expected)
    if here is None:
        return
    choice = blocks_kernel(kind, here, torch.device("cpu"), 128)
    assert choice.reason.startswith(f"latentserve's kernels: 128 inputs, latentserve's {file_type} kernel needs a "
                                    "multiple")


@pytest.mark.skipif(default_policy().kernels is None, reason="latentserve's kernels do not build here")
def test_a_q3k_layer_gives_the_bits_its_values_gave_as_q6k(monkeypatch):
    """Q3_K's own kernel reads 3.625 bits a weight where its values as Q6_K's (q + 28, the same d and sc) read 6.625:
    the same arithmetic, so the same bits, at one row, a few and many."""
    monkeypatch.delenv(NATIVE_ENV, raising=False)
    weight = q3k_weight(k_quant_blocks((48, 512), GGMLQuantizationType.Q3_K, np.random.default_rng(0)))
    here = _policy(cpu_features())
    q3k, q6k = (quantize_linear("l", w, None, QuantConfig("int8"), "cpu", here)
                for w in (weight, Q6KWeight(weight.q + 28, weight.d, weight.sc)))
    assert type(q3k) is NativeQ3KLinear and type(q6k) is NativeQ6KLinear
    assert q3k.packed.numel() * 6625 == q6k.packed.numel() * 3625
    for rows in (1, 5, 64):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(q3k(x), q6k(x)), rows


def test_gguf_5_bit_weights_run_latentserves_kernels_or_int8_per_row(monkeypatch):
    """Q5_0's, Q5_1's and Q5_K's blocks as they are where latentserve's kernels run and the inputs are a multiple of 64
    (Q5_K: 256); elsewhere their values quantized to int8 per row."""
    monkeypatch.delenv(NATIVE_ENV, raising=False)
    gen = np.random.default_rng(0)
    weight = q50_weight(quantize(gen.standard_normal((48, 1408)).astype(np.float32), GGMLQuantizationType.Q5_0))
    x = torch.randn(5, 1408, generator=torch.Generator().manual_seed(1))
    expected = x @ weight.dequantize().t()
    int4 = QuantConfig("int4", 32)
    layer = quantize_linear("l", weight, None, int4, "cpu", _policy(cpu_features(), kernels=False))
    assert isinstance(layer, IntMMInt8Linear) and torch.equal(layer.scale, quantize_int8(weight.dequantize())[1])
    here = _policy(cpu_features())
    if here.kernels is None:
        return
    layer = quantize_linear("l", weight, None, int4, "cpu", here)
    assert isinstance(layer, NativeQ50Linear) and layer.kernels is here.kernels
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=2e-2 * expected.abs().max().item())
    assert layer(x.bfloat16()).dtype == torch.bfloat16
    q51 = q51_weight(quantize(gen.standard_normal((48, 1408)).astype(np.float32), GGMLQuantizationType.Q5_1))
    layer = quantize_linear("l", q51, None, int4, "cpu", here)
    assert isinstance(layer, NativeQ51Linear)
    expected = x @ q51.dequantize().t()
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=2e-2 * expected.abs().max().item())
    k_quant = q5k_weight(k_quant_blocks((48, 512), GGMLQuantizationType.Q5_K, gen))
    layer = quantize_linear("l", k_quant, None, int4, "cpu", here)
    assert isinstance(layer, NativeQ5KLinear)
    expected = x[:, :512] @ k_quant.dequantize().t()
    torch.testing.assert_close(layer(x[:, :512]), expected, rtol=0, atol=2e-2 * expected.abs().max().item())
    odd = q50_weight(quantize(gen.standard_normal((16, 96)).astype(np.float32), GGMLQuantizationType.Q5_0))
    choice = blocks_kernel(Q50Weight, here, torch.device("cpu"), 96)
    assert choice.reason.startswith("latentserve's kernels: 96 inputs, latentserve's Q5_0 kernel needs a multiple")
    assert type(quantize_linear("l", odd, None, int4, "cpu", here)) is NativeInt8Linear


def test_gguf_q4k_runs_its_blocks_or_int4s_groups_of_its_values(monkeypatch):
    """Q4_K's blocks as they are where latentserve's kernels run; elsewhere its exact values as int4's groups of 32
    (not int8 per row: twice the bytes)."""
    monkeypatch.delenv(NATIVE_ENV, raising=False)
    weight = q4k_weight(k_quant_blocks((48, 512), GGMLQuantizationType.Q4_K, np.random.default_rng(0)))
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(1))
    expected = x @ weight.dequantize().t()
    int4 = QuantConfig("int4", 32)
    without = _policy(cpu_features(), kernels=False)
    choice = blocks_kernel(Q4KWeight, without, torch.device("cpu"), 512)
    assert choice.kernel == Int4PackLinear.kernel and choice.reason.endswith("as int4's groups of 32 (scale d * sc, "
                                                                             "minimum -dmin * m)")
    layer = quantize_linear("l", weight, None, int4, "cpu", without)
    assert isinstance(layer, Int4PackLinear)
    torch.testing.assert_close(layer(x), expected, rtol=0, atol=2e-2 * expected.abs().max().item())
    _runs_on_the_kernels(weight, NativeQ4KLinear, x, expected)


@pytest.mark.skipif(int4pack_block_n() is None, reason="int4pack layout not known on this CPU capability")
@pytest.mark.parametrize("rows", [INT4_DEQUANT_ROWS - 1, INT4_DEQUANT_ROWS, 3 * INT4_DEQUANT_ROWS])
def test_int4pack_many_rows_dequantize_once_and_match_the_dequantized_weight(rows):
    """From INT4_DEQUANT_ROWS rows on the layer unpacks its int4pack weight for one plain GEMM: same arithmetic."""
    w, bias, _ = _layer(128, 256)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(3))
    q, scale, minimum = quantize_int4(w, 64)
    reference = dequantize_int4(q, scale, minimum)
    exact = Int4PackLinear(q, scale, minimum, torch.nn.Parameter(bias), torch.float32)
    torch.testing.assert_close(exact.dequantized(), reference, rtol=0, atol=1e-6)
    torch.testing.assert_close(exact(x), x @ reference.t() + bias, rtol=1e-4, atol=1e-4)
    fast = Int4PackLinear(q, scale, minimum, torch.nn.Parameter(bias), torch.bfloat16)
    # bf16 scales and zeros: within bf16 round-off of the fp32 weight, and the same weight the kernel uses.
    torch.testing.assert_close(fast.dequantized().float(), reference, rtol=0, atol=1e-2 * reference.abs().max().item())
    one_row = torch.cat([fast(x[i : i + 1]) for i in range(4)])  # 1 row: int4pack_mm itself
    torch.testing.assert_close(fast(x)[:4], one_row, rtol=2e-2, atol=2e-2 * one_row.abs().max().item())
    expected = x @ reference.t() + bias
    torch.testing.assert_close(fast(x), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
    fp32_gemm = Int4PackLinear(q, scale, minimum, torch.nn.Parameter(bias), torch.bfloat16, torch.float32)  # AVX2's
    assert fp32_gemm.dequantized().dtype == torch.float32
    torch.testing.assert_close(fp32_gemm(x), expected, rtol=2e-2, atol=1e-2 * expected.abs().max().item())


AVX2_CHECK = """
import torch
from latentserve.layers.quant.int4 import Int4PackLinear, dequantize_int4, int4pack_block_n, quantize_int4
w = torch.randn(96, 128, generator=torch.Generator().manual_seed(0))
q, scale, minimum = quantize_int4(w, 32)
layer = Int4PackLinear(q, scale, minimum, None, torch.float32)
x = torch.randn(80, 128, generator=torch.Generator().manual_seed(1))
print(torch.backends.cpu.get_cpu_capability(), int4pack_block_n(), layer.dequant_rows,
      (layer.dequantized() - dequantize_int4(q, scale, minimum)).abs().max().item(),
      (layer(x) - x @ dequantize_int4(q, scale, minimum).t()).abs().max().item())
"""


def test_int4pack_layout_is_found_under_avx2():
    """torch packs int4 in blocks of 32 output rows on AVX2 (64 on AVX-512): the probe finds it, the unpacked
    weight is the quantized one."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", AVX2_CHECK], env=env, capture_output=True, text=True, check=True)
    capability, block, dequant_rows, weight_error, output_error = out.stdout.split()
    assert (capability, block, dequant_rows) == ("AVX2", "32", str(INT4_DEQUANT_ROWS))
    assert float(weight_error) < 1e-6 and float(output_error) < 1e-4


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_lm_head_is_quantized_to_int8_unless_kept(tmp_path, method):
    """lm_head: int8 under int8 and int4 (llama.cpp keeps Q4_K_M's output matrix at 6 bits), or left alone."""
    from latentserve.models import load_model
    from latentserve.models.loader import SINGLE_FILE
    from safetensors.torch import load_file
    from tests.checkpoints import make_checkpoint

    src = make_checkpoint(tmp_path, "v3", q_lora_rank=32, moe_intermediate_size=32, intermediate_size=64)
    stored = load_file(src / SINGLE_FILE)["lm_head.weight"]
    group = 32 if method == "int4" else None
    model = load_model(src, quantization=QuantConfig(method, group, lm_head=True))
    assert type(model.lm_head).kernel == quant_linear.int8_kernel(default_policy(), torch.device("cpu")).kernel
    hidden = torch.randn(3, stored.shape[1], generator=torch.Generator().manual_seed(2))
    q, scale = quantize_int8(stored)
    expected = hidden @ (q.float() * scale[:, None]).t()
    got = model.compute_logits(hidden)
    assert got.dtype == torch.float32
    if not isinstance(model.lm_head, Int8Linear):  # the kernel's fp32 logits, not rounded to bf16 on the way
        assert model.lm_head(hidden.bfloat16()).dtype == torch.float32
    # The fast kernels quantize the activations to 8 bits as well: within a few of their steps.
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-2 * expected.abs().max().item())
    kept = load_model(src, quantization=QuantConfig(method, group, lm_head=False))
    assert torch.equal(kept.lm_head.weight, stored)
