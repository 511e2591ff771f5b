"""What the loader leaves of the MLPs: plain routed experts stacked, quantized gate and up fused into one layer."""
from __future__ import annotations


import pytest
import torch
from safetensors.torch import load_file

from latentserve.layers.mlp import GatedMLP
from latentserve.layers.moe import MoE
from latentserve.layers.quant.config import QuantConfig
from latentserve.layers.quant import linear as quant_linear
from latentserve.layers.quant.int8 import Int8Linear, quantize_int8
from latentserve.models import load_model
from latentserve.models.loader import SINGLE_FILE
from tests.checkpoints import make_checkpoint


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_experts_are_stacked_from_the_checkpoint(tmp_path, dtype) -> None:
    src = make_checkpoint(tmp_path, "v3")
    tensors = load_file(src / SINGLE_FILE)
    model = load_model(src, dtype=dtype)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert moes and all(m.stacked is not None for m in moes)
    stacked = model.model.layers[1].mlp.stacked
    prefix = "model.layers.1.mlp.experts.5"
    gate, up = tensors[f"{prefix}.gate_proj.weight"], tensors[f"{prefix}.up_proj.weight"]
    assert torch.equal(stacked.w13[5], torch.cat([gate, up]).to(dtype))
    assert torch.equal(stacked.w2[5], tensors[f"{prefix}.down_proj.weight"].to(dtype))


def test_quantized_gate_and_up_are_one_layer_quantized_as_the_two(tmp_path, monkeypatch) -> None:
    """Every bias-free MLP (dense, shared, routed) gets one gate_up layer; per-row int8 of the fused weight equals
    the two halves' own quantization."""
    # The portable kernel: it holds the int8 weight as it is.
    monkeypatch.setattr(quant_linear, "int8_kernel", lambda *args: quant_linear.KernelChoice(Int8Linear.kernel, "test"))
    src = make_checkpoint(tmp_path, "v3")
    tensors = load_file(src / SINGLE_FILE)
    model = load_model(src, dtype=torch.float32, quantization=QuantConfig("int8"))
    mlps = {name: m for name, m in model.named_modules() if isinstance(m, GatedMLP)}
    assert mlps and all(m.gate_up_proj is not None and not hasattr(m, "gate_proj") for m in mlps.values())
    assert all(m.stacked is None for m in model.modules() if isinstance(m, MoE))
    prefix = "model.layers.1.mlp.experts.3"
    layer = mlps[prefix].gate_up_proj
    q_gate, s_gate = quantize_int8(tensors[f"{prefix}.gate_proj.weight"])
    q_up, s_up = quantize_int8(tensors[f"{prefix}.up_proj.weight"])
    assert torch.equal(layer.qweight, torch.cat([q_gate, q_up])) and torch.equal(layer.scale, torch.cat([s_gate, s_up]))
