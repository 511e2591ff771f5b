"""Quantization at load: the blockwise quantizers give exactly the values of the plain whole-tensor formulas, and
the loader's worker threads install exactly those in every quantized layer."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from latentserve.layers.quant import linear as quant_linear
from latentserve.layers.quant.config import QuantConfig
from latentserve.layers.quant.int4 import quantize_int4
from latentserve.layers.quant.int8 import BLOCK_ELEMENTS, quantize_int8
from latentserve.models import load_model
from latentserve.models.loader import SINGLE_FILE, checkpoint_name
from tests.checkpoints import make_checkpoint


def naive_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = weight.float()
    scale = w.abs().max(dim=1).values.clamp(min=1e-12) / 127
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def naive_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w = weight.float().view(weight.shape[0], -1, group_size)
    minimum, maximum = w.min(dim=-1).values, w.max(dim=-1).values
    scale = (maximum - minimum).clamp(min=1e-12) / 15
    q = ((w - minimum[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
    return q.view(weight.shape), scale, minimum


def weights(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """Random weights with the rows quantization must not get wrong: all zero, constant, one outlier."""
    g = torch.Generator().manual_seed(shape[0] * shape[1])
    w = torch.randn(shape, generator=g) * 0.02
    w[0] = 0
    if shape[0] > 2:
        w[1] = 0.5
        w[2, -1] = 3.0
    return w.to(dtype)


# Rows split unevenly over blocks; a row longer than one block; a single row.
SHAPES = [(300, 1024), (3, BLOCK_ELEMENTS + 256), (1, 128)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_int8_equals_the_whole_tensor_formula(shape, dtype) -> None:
    w = weights(shape, dtype)
    q, scale = quantize_int8(w)
    expected_q, expected_scale = naive_int8(w)
    assert torch.equal(q, expected_q) and torch.equal(scale, expected_scale)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group_size", [32, 128])
def test_int4_equals_the_whole_tensor_formula(shape, dtype, group_size) -> None:
    w = weights(shape, dtype)
    for got, expected in zip(quantize_int4(w, group_size), naive_int4(w, group_size), strict=True):
        assert torch.equal(got, expected)


def source_weight(name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The checkpoint weight a quantized layer was made from (a fused gate_up from its two halves)."""
    if name.endswith(".gate_up_proj"):
        mlp = checkpoint_name(name.removesuffix(".gate_up_proj"))
        return torch.cat([tensors[f"{mlp}.gate_proj.weight"], tensors[f"{mlp}.up_proj.weight"]])
    return tensors[checkpoint_name(f"{name}.weight")]


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("threads", [1, 2])
def test_threaded_load_installs_the_whole_tensor_quantization(tmp_path, monkeypatch, method, threads) -> None:
    """Each quantized layer of a loaded model computes exactly what the same kernel computes on the checkpoint
    weight quantized by the plain formula, however many threads quantize."""
    # Every width a multiple of int4's 32-column groups.
    src = make_checkpoint(tmp_path, "v3", dtype=torch.bfloat16, q_lora_rank=32, moe_intermediate_size=32,
                          intermediate_size=64)
    tensors = load_file(src / SINGLE_FILE)
    config = QuantConfig(method, 32 if method == "int4" else None)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = load_model(src, dtype=torch.bfloat16, quantization=config)
        assert torch.get_num_threads() == threads  # the workers' single thread stays theirs
    finally:
        torch.set_num_threads(previous)
    monkeypatch.setattr(quant_linear, "quantize_int8", naive_int8)
    monkeypatch.setattr(quant_linear, "quantize_int4", naive_int4)
    layers = {name: m for name, m in model.named_modules() if hasattr(m, "kernel")}
    assert any(name.endswith(".gate_up_proj") for name in layers) and len(layers) > 10
    x = torch.randn(3, max(m.in_features for m in layers.values()), generator=torch.Generator().manual_seed(1))
    for name, layer in layers.items():
        expected = quant_linear.quantize_linear(name, source_weight(name, tensors), layer.bias, config, "cpu")
        assert type(expected) is type(layer), name
        inputs = x[:, :layer.in_features].bfloat16()
        assert torch.equal(layer(inputs), expected(inputs)), name
