"""A decode step's last layers in one native call (models/decode_layers.py, kernels/decode_layers.c) against the same
layers' one-call blocks called one by one: the same logits and caches to the bit, the run taken where every layer
would take its blocks (the dense first layer before it), left where a step or a layer does not qualify, and rebuilt
when a weight is replaced."""
from __future__ import annotations

import pytest
import torch

from latentserve.config import AttentionConfig
from latentserve.kernels import native
from latentserve.kernels.policy import default_policy
from latentserve.layers.quant.config import QuantConfig
from latentserve.models import deepseek, load_model
from tests.checkpoints import make_checkpoint
from tests.models.paged import PagedRunner

pytestmark = pytest.mark.skipif(default_policy().kernels is None, reason="latentserve's kernels do not build here")

# Prefills, decodes of one and two requests, a prefill beside a decode (the run's metadata check), 9 requests at once
# (past the quantized experts' one-call limit of 8 tokens: the layers one by one).
BATCHES = [[(0, 5), (1, 7)], [(0, 1), (1, 1)], [(1, 1)], [(1, 1)], [(0, 2)], [(1, 1), (2, 4)], [(1, 1), (0, 1)],
           [(r, 3) for r in range(3, 12)], [(r, 1) for r in range(3, 12)], [(2, 1), (0, 1)]]


def _checkpoint(tmp_path, variant: str):
    # int4's inputs in multiples of 64; the kernels' per-head products in multiples of 16.
    extra = {"q_lora_rank": 64} if variant == "v3" else {}
    return make_checkpoint(tmp_path, variant, hidden_size=64, intermediate_size=64, moe_intermediate_size=64,
                           kv_lora_rank=64, v_head_dim=16, num_hidden_layers=4, **extra)


def _run(path, dtype: torch.dtype, quantization: QuantConfig | None, cache_dtype: torch.dtype = torch.float32):
    attn_config = AttentionConfig(block_size=4)
    model = load_model(path, dtype=dtype, attn_config=attn_config, quantization=quantization)
    runner = PagedRunner(model, attn_config, cache_dtype=cache_dtype)
    g = torch.Generator().manual_seed(0)
    logits = [runner.step([(r, torch.randint(0, 96, (n,), generator=g).tolist()) for r, n in batch])
              for batch in BATCHES]
    caches = [layer.kv_cache.view(torch.uint8).clone() for layer in model.static_forward_context.values()]
    return logits, caches, model


def _spy(monkeypatch) -> list[int]:
    """The tokens of each run's call, which must end in the model's final norm (its last argument)."""
    calls = []
    monkeypatch.setattr(native, "decode_layers", lambda *a, _f=native.decode_layers: calls.append(
        a[2].shape[0] if a[-1] is not None else None) or _f(*a))
    return calls


def _one_by_one(monkeypatch) -> None:
    monkeypatch.setattr(deepseek, "layer_run", lambda *a: None)


@pytest.mark.parametrize("variant", ["v2_lite", "v3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("quantization", [None, QuantConfig("int8"), QuantConfig("int4", 32)], ids=str)
def test_the_run_equals_the_blocks_one_by_one(tmp_path, monkeypatch, variant, dtype, threads, quantization):
    path = _checkpoint(tmp_path, variant)
    calls = _spy(monkeypatch)
    run, run_caches, model = _run(path, dtype, quantization)
    built = model.model.run_view._entry[3]
    # One token: from the dense first layer where its MLP runs the experts kernel (quantized), else after it.
    assert (built.one.first, built.many.first) == (0 if quantization else 1, 1)
    # The decode steps of one and two tokens (the attention blocks' per-head products take up to 2 here).
    assert sorted(set(calls)) == [1, 2]
    _one_by_one(monkeypatch)
    calls.clear()
    blocks, block_caches, _ = _run(path, dtype, quantization)
    assert not calls
    for a, b in zip(run, blocks):
        assert torch.equal(a, b)
    for a, b in zip(run_caches, block_caches):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.int8])
def test_the_run_over_each_cache_dtype(tmp_path, monkeypatch, cache_dtype):
    path = _checkpoint(tmp_path, "v3")
    calls = _spy(monkeypatch)
    run, run_caches, _ = _run(path, torch.bfloat16, QuantConfig("int8"), cache_dtype)
    assert calls
    _one_by_one(monkeypatch)
    blocks, block_caches, _ = _run(path, torch.bfloat16, QuantConfig("int8"), cache_dtype)
    for a, b in zip(run + run_caches, blocks + block_caches):
        assert torch.equal(a, b)


def test_a_replaced_weight_rebuilds_the_run(tmp_path):
    """The run is built once and reused; an expert weight replaced through its module rebuilds it (and the layer's
    MoE block), and the rebuilt run equals the blocks one by one over the new weight."""
    path = _checkpoint(tmp_path, "v3")
    attn_config = AttentionConfig(block_size=4)
    logits, builds = [], []
    for one_by_one in (False, True):
        model = load_model(path, dtype=torch.float32, attn_config=attn_config, quantization=QuantConfig("int8"))
        if one_by_one:
            model.model.run_view.get = lambda key, build: None
        runner, view = PagedRunner(model, attn_config), model.model.run_view
        steps = [runner.step([(0, [1, 2, 3]), (1, [4, 5])]), runner.step([(0, [6]), (1, [7])])]
        builds.append(view.builds)
        down = model.model.layers[2].mlp.experts[0].down_proj
        down.register_buffer("packed", torch.flip(down.packed, dims=[0]).contiguous())
        steps.append(runner.step([(0, [8]), (1, [9])]))
        builds.append(view.builds)
        logits.append(steps)
    assert builds[:2] == [1, 2]
    for a, b in zip(*logits):
        assert torch.equal(a, b)


def test_a_layer_without_its_blocks_ends_the_run_after_it(tmp_path, monkeypatch):
    """A layer that would run its modules (here: its MoE block refused) keeps the run to the layers after it."""
    path = _checkpoint(tmp_path, "v3")
    attn_config = AttentionConfig(block_size=4)
    model = load_model(path, dtype=torch.float32, attn_config=attn_config, quantization=QuantConfig("int8"))
    model.model.layers[2].decode_blocks = lambda dtype: None
    runner = PagedRunner(model, attn_config)
    runner.step([(0, [1, 2, 3])])
    runner.step([(0, [4])])
    assert (model.model.run_view._entry[3].one.first, model.model.run_view._entry[3].many.first) == (3, 3)
    model.model.layers[3].decode_blocks = lambda dtype: None
    model.model.run_view._entry = None
    runner.step([(0, [5])])
    assert model.model.run_view._entry[3] is None
