"""The one-call decode MoE block (models/moe_block.py, kernels/moe_block.c) against the layer's modules run one by
one: the same logits to the bit, taken where it applies, and rebuilt when a weight is replaced."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from latentserve.config import AttentionConfig
from latentserve.kernels import native
from latentserve.kernels.policy import default_policy
from latentserve.layers.moe import MoE
from latentserve.layers.quant.config import QuantConfig
from latentserve.layers.quant.linear import quantize_linear
from latentserve.models import deepseek, load_model, moe_block
from tests.checkpoints import make_checkpoint
from tests.models.paged import PagedRunner

pytestmark = pytest.mark.skipif(default_policy().kernels is None, reason="latentserve's kernels do not build here")

# Decodes of one and two requests, a short prefill the block takes and longer ones it leaves to the modules.
BATCHES = [[(0, 5), (1, 7)], [(0, 1), (1, 1)], [(1, 1)], [(1, 1)], [(0, 2)], [(1, 1), (0, 1)], [(2, 3)], [(2, 1)]]


@pytest.fixture(autouse=True)
def _blocks_one_by_one(monkeypatch):
    """Each layer's blocks called one by one (the decode run chains the same blocks: test_decode_layers.py)."""
    monkeypatch.setattr(deepseek, "layer_run", lambda *a: None)



def _model(path, dtype: torch.dtype, quantization: QuantConfig | None):
    attn_config = AttentionConfig(block_size=4)
    return load_model(path, dtype=dtype, attn_config=attn_config, quantization=quantization), attn_config


def _run(model, attn_config) -> list[torch.Tensor]:
    runner = PagedRunner(model, attn_config)
    g = torch.Generator().manual_seed(0)
    return [runner.step([(r, torch.randint(0, 96, (n,), generator=g).tolist()) for r, n in batch])
            for batch in BATCHES]


def _checkpoint(tmp_path, variant: str, **overrides):
    # int4's inputs in multiples of 64: the hidden size, the experts' (the shared MLP's is twice theirs), q_lora's.
    if variant != "v2_lite":
        overrides["q_lora_rank"] = 64
    return make_checkpoint(tmp_path, variant, hidden_size=64, intermediate_size=64, moe_intermediate_size=64,
                           kv_lora_rank=64, v_head_dim=16, **overrides)


def _as_the_modules(monkeypatch, quantization: QuantConfig | None) -> None:
    """Where the modules run the same kernels: quantized experts through the one call at one token only (at several
    the modules go expert by expert; `test_quantized_tokens_each_as_alone` covers those)."""
    if quantization:
        monkeypatch.setattr(moe_block, "NATIVE_MAX_TOKENS", 1)


def _calls(monkeypatch) -> list[int]:
    calls = []
    monkeypatch.setattr(native, "moe_block", lambda *a, _f=native.moe_block: calls.append(a[2].shape[0]) or _f(*a))
    return calls


@pytest.mark.parametrize("variant", ["v2_lite", "v2_group", "v3"])  # softmax; softmax + groups; sigmoid + bias
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
# int4 by default: groups of 64 over the experts' inputs, 128 over the shared MLP's down projection.
@pytest.mark.parametrize("quantization", [None, QuantConfig("int8"), QuantConfig("int4", 32), QuantConfig("int4")],
                         ids=str)
def test_fused_moe_equals_the_modules(tmp_path, monkeypatch, variant, dtype, threads, quantization):
    path = _checkpoint(tmp_path, variant)
    calls = _calls(monkeypatch)
    _as_the_modules(monkeypatch, quantization)
    fused = _run(*_model(path, dtype, quantization))
    # Stacked experts take every step of up to 3 tokens (the router's product on latentserve's kernel), prefills
    # included; quantized ones (here) the one-token steps.
    assert calls and max(calls) == (1 if quantization else 3)
    monkeypatch.setattr(deepseek, "fused_moe", lambda *a: None)
    modules = _run(*_model(path, dtype, quantization))
    for a, b in zip(fused, modules):
        assert torch.equal(a, b)


def _without_shared_experts(path, quantization):
    model, attn_config = _model(path, torch.bfloat16, quantization)
    for layer in model.model.layers:
        if isinstance(layer.mlp, MoE):  # (transformers cannot save a checkpoint without them)
            layer.mlp.shared_experts = None
            if layer.mlp.stacked is not None:
                layer.mlp.stacked.shared = None
    return model, attn_config


@pytest.mark.parametrize("quantization", [None, QuantConfig("int8")], ids=str)
def test_fused_moe_without_shared_experts(tmp_path, monkeypatch, quantization):
    path = _checkpoint(tmp_path, "v3")
    calls = _calls(monkeypatch)
    _as_the_modules(monkeypatch, quantization)
    fused = _run(*_without_shared_experts(path, quantization))
    assert calls
    monkeypatch.setattr(deepseek, "fused_moe", lambda *a: None)
    for a, b in zip(fused, _run(*_without_shared_experts(path, quantization))):
        assert torch.equal(a, b)


def _int8_downs(model) -> None:
    """Every MoE layer's down projections (routed and shared) replaced by int8 ones, as llama.cpp's Q4_K_M files keep
    some down projections at 8 bits beside 4-bit gate and up."""
    g = torch.Generator().manual_seed(5)
    for layer in model.model.layers:
        if isinstance(layer.mlp, MoE):
            for mlp in [*layer.mlp.experts, layer.mlp.shared_experts]:
                down = mlp.down_proj
                w = torch.randn(down.out_features, down.in_features, generator=g) * 0.1
                mlp.down_proj = quantize_linear("down_proj", w, None, QuantConfig("int8"), "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_fused_moe_takes_int4_gate_up_beside_int8_down(tmp_path, monkeypatch, dtype, threads):
    """Each projection in its own format: the one call takes the layer, and equals the modules to the bit."""
    path, quantization = _checkpoint(tmp_path, "v3"), QuantConfig("int4", 32)
    calls = _calls(monkeypatch)
    _as_the_modules(monkeypatch, quantization)
    model, attn_config = _model(path, dtype, quantization)
    _int8_downs(model)
    fused = _run(model, attn_config)
    assert calls and max(calls) == 1
    monkeypatch.setattr(deepseek, "fused_moe", lambda *a: None)
    for a, b in zip(fused, _run(model, attn_config)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("quantization", [None, QuantConfig("int4", 32)], ids=str)
def test_a_replaced_weight_rebuilds_the_view(tmp_path, monkeypatch, quantization):
    _as_the_modules(monkeypatch, quantization)
    model, attn_config = _model(_checkpoint(tmp_path, "v3"), torch.float32, quantization)
    layers = [layer for layer in model.model.layers if isinstance(layer.mlp, MoE)]
    assert all(layer.moe_view.builds == 1 for layer in layers)  # built once, after the weights were loaded
    before = _run(model, attn_config)
    assert all(layer.moe_view.builds == 1 for layer in layers)  # reused every step
    router = layers[0].mlp.gate
    router.weight = nn.Parameter(torch.flip(router.weight.detach(), dims=[0]))  # other experts win
    after = _run(model, attn_config)
    assert layers[0].moe_view.builds == 2 and not torch.equal(before[-1], after[-1])
    # The modules over the same replaced weight agree with the rebuilt view.
    with pytest.MonkeyPatch.context() as m:
        m.setattr(deepseek, "fused_moe", lambda *a: None)
        for a, b in zip(after, _run(model, attn_config)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("variant", ["v2_lite", "v3"])
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("quantization, int8_downs", [(QuantConfig("int8"), False), (QuantConfig("int4", 32), False),
                                                      (QuantConfig("int4", 32), True)], ids=str)
def test_quantized_tokens_each_as_alone(tmp_path, variant, threads, quantization, int8_downs):
    """Up to 8 tokens through quantized experts in one call: each token's output equals that token's alone (experts
    that several tokens chose are read once for all of them), and the modules' within their roundings; also with
    int4 gate_up beside int8 down."""
    model, _ = _model(_checkpoint(tmp_path, variant), torch.bfloat16, quantization)
    if int8_downs:
        _int8_downs(model)
    layer = next(layer for layer in model.model.layers if isinstance(layer.mlp, MoE))
    g = torch.Generator().manual_seed(1)
    normed, hidden = (torch.randn(8, 64, generator=g).bfloat16() for _ in range(2))
    together = moe_block.fused_moe(layer.mlp, layer.moe_view, normed, hidden)
    assert together is not None
    # With 8 tokens over 8 experts top-2, some expert serves several tokens.
    assert len(set(layer.mlp.gate(normed)[1].flatten().tolist())) < 16
    for t in range(8):
        alone = moe_block.fused_moe(layer.mlp, layer.moe_view, normed[t:t + 1], hidden[t:t + 1])
        assert torch.equal(together[t:t + 1], alone)
    with torch.no_grad():
        modules = hidden + layer.mlp(normed)
    # bf16 outputs summed in another order (and torch's SiLU): a couple of bf16 steps of the output's scale.
    assert (together.float() - modules.float()).abs().max() <= 0.02 * modules.float().abs().max()
