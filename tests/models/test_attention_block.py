"""The one-call decode attention block (models/attention_block.py, kernels/attention_block.c) against the layer's
modules run one by one: the same logits and cache to the bit, and taken where it applies."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from latentserve.config import AttentionConfig
from latentserve.kernels import native
from latentserve.kernels.policy import default_policy
from latentserve.layers.quant.config import QuantConfig
from latentserve.models import deepseek, load_model
from tests.checkpoints import make_checkpoint
from tests.models.paged import PagedRunner


@pytest.fixture(autouse=True)
def _blocks_one_by_one(monkeypatch):
    """Each layer's blocks called one by one (the decode run chains the same blocks: test_decode_layers.py)."""
    monkeypatch.setattr(deepseek, "layer_run", lambda *a: None)



def _run(path, dtype: torch.dtype, quantization: QuantConfig | None,
         cache_dtype: torch.dtype = torch.float32) -> tuple[list[torch.Tensor], PagedRunner]:
    """Prefill two prompts, then decode one token each, then one request alone over 1 and 2 new tokens."""
    attn_config = AttentionConfig(block_size=4)
    model = load_model(path, dtype=dtype, attn_config=attn_config, quantization=quantization)
    runner = PagedRunner(model, attn_config, cache_dtype=cache_dtype)
    g = torch.Generator().manual_seed(0)
    tokens = lambda n: torch.randint(0, 96, (n,), generator=g).tolist()  # noqa: E731
    batches = [[(0, tokens(5)), (1, tokens(7))], [(0, tokens(1)), (1, tokens(1))], [(1, tokens(1))],
               [(1, tokens(1))], [(0, tokens(2))], [(1, tokens(1)), (0, tokens(1))]]
    return [runner.step(batch) for batch in batches], runner


@pytest.mark.skipif(default_policy().kernels is None, reason="latentserve's kernels do not build here")
@pytest.mark.parametrize("variant", ["v2_lite", "v3"])  # no q_lora / q_lora
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("quantization", [None, QuantConfig("int8"), QuantConfig("int4", 32)], ids=str)
def test_fused_block_equals_the_modules(tmp_path, monkeypatch, variant, dtype, threads, quantization):
    # The per-head kernel's multiples of 16; int4's inputs in multiples of 64.
    path = make_checkpoint(tmp_path, variant, kv_lora_rank=64, v_head_dim=16, hidden_size=64, intermediate_size=64,
                           moe_intermediate_size=64, **({"q_lora_rank": 64} if variant == "v3" else {}))
    calls = []
    monkeypatch.setattr(native, "mla_attention_block", lambda *a, _f=native.mla_attention_block: calls.append(
        a[3].shape[0]) or _f(*a))
    fused, fused_runner = _run(path, dtype, quantization)
    assert calls and max(calls) >= 2  # decode steps of one and two tokens took it
    monkeypatch.setattr(deepseek, "fused_attention", lambda *a: None)
    modules, module_runner = _run(path, dtype, quantization)
    for a, b in zip(fused, modules):
        assert torch.equal(a, b)
    for name, cache in fused_runner.model.static_forward_context.items():
        other = module_runner.model.static_forward_context[name].kv_cache
        assert torch.equal(cache.kv_cache.nan_to_num(), other.nan_to_num())


@pytest.mark.skipif(default_policy().kernels is None, reason="latentserve's kernels do not build here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.int8])
def test_fused_block_over_a_quantized_cache_equals_the_modules(tmp_path, monkeypatch, dtype, cache_dtype):
    """The block writes and reads an fp8 (e4m3) or int8 cache as the prologue and decode kernels called one by one
    do."""
    path = make_checkpoint(tmp_path, "v3", kv_lora_rank=64, v_head_dim=16, hidden_size=64, intermediate_size=64,
                           moe_intermediate_size=64, q_lora_rank=64)
    calls = []
    monkeypatch.setattr(native, "mla_attention_block", lambda *a, _f=native.mla_attention_block: calls.append(
        a[3].shape[0]) or _f(*a))
    fused, fused_runner = _run(path, dtype, None, cache_dtype)
    assert calls
    monkeypatch.setattr(deepseek, "fused_attention", lambda *a: None)
    modules, module_runner = _run(path, dtype, None, cache_dtype)
    for a, b in zip(fused, modules):
        assert torch.equal(a, b)
    for name, layer in fused_runner.model.static_forward_context.items():
        other = module_runner.model.static_forward_context[name].kv_cache
        assert layer.kv_cache.dtype == cache_dtype
        assert torch.equal(layer.kv_cache.view(torch.uint8), other.view(torch.uint8))


def _decode_steps(path, quantization: QuantConfig) -> list[torch.Tensor]:
    """Nine requests prefilled, then decode steps of 1, 2, 5 and 9 of them."""
    attn_config = AttentionConfig(block_size=4)
    model = load_model(path, dtype=torch.bfloat16, attn_config=attn_config, quantization=quantization)
    runner = PagedRunner(model, attn_config)
    logits = [runner.step([(r, [r + 1, r + 2, r + 3]) for r in range(9)])]
    return logits + [runner.step([(r, [10 + r + t]) for r in range(t)]) for t in (1, 2, 5, 9)]


@pytest.mark.skipif(default_policy().kernels is None, reason="latentserve's kernels do not build here")
@pytest.mark.parametrize("threads", [1, 2, 3], indirect=True)
@pytest.mark.parametrize("quantization", [QuantConfig("int8"), QuantConfig("int4", 32)], ids=str)
def test_quantized_q_lora_block_equals_the_modules_at_few_tokens(tmp_path, monkeypatch, threads, quantization):
    """A q-LoRA block with q_a and kv_a in quant_linear's formats: at 1-3 threads and 1, 2, 5 and 9 tokens (blocks
    read in pairs up to 8 rows, one at a time above; kv_a's 72 outputs end in a short block) the block equals the
    modules."""
    path = make_checkpoint(tmp_path, "v3", kv_lora_rank=64, v_head_dim=16, hidden_size=64, intermediate_size=64,
                           moe_intermediate_size=64, q_lora_rank=64)
    calls = []
    monkeypatch.setattr(native, "mla_attention_block", lambda *a, _f=native.mla_attention_block: calls.append(
        a[3].shape[0]) or _f(*a))
    fused = _decode_steps(path, quantization)
    assert set(calls) == {1, 2, 5, 9}
    monkeypatch.setattr(deepseek, "fused_attention", lambda *a: None)
    for a, b in zip(fused, _decode_steps(path, quantization)):
        assert torch.equal(a, b)


def _replace(o_proj: nn.Module) -> None:
    """A new o_proj weight (its rows reversed), installed through the module as a loader would."""
    if isinstance(o_proj, nn.Linear):
        o_proj.weight = nn.Parameter(torch.flip(o_proj.weight.detach(), dims=[0]))
        return
    o_proj.register_buffer("packed", torch.flip(o_proj.packed, dims=[0]).contiguous())  # its blocks of 16 reversed


def _replaced_run(path, quantization: QuantConfig | None) -> tuple[list[torch.Tensor], list[int]]:
    """A prefill and a decode, o_proj of layer 0 replaced, another decode: the logits, and layer 0's block builds
    after loading, after the first decode and after the replacement."""
    attn_config = AttentionConfig(block_size=4)
    model = load_model(path, dtype=torch.float32, attn_config=attn_config, quantization=quantization)
    runner, attn = PagedRunner(model, attn_config), model.model.layers[0].self_attn
    builds = [attn.fused_block.builds]
    logits = [runner.step([(0, [1, 2, 3]), (1, [4, 5])]), runner.step([(0, [6]), (1, [7])])]
    builds.append(attn.fused_block.builds)
    _replace(attn.o_proj)
    logits.append(runner.step([(0, [8]), (1, [9])]))
    return logits, builds + [attn.fused_block.builds]


@pytest.mark.skipif(default_policy().kernels is None, reason="latentserve's kernels do not build here")
@pytest.mark.parametrize("quantization", [None, QuantConfig("int8")], ids=str)
def test_a_replaced_weight_rebuilds_the_block(tmp_path, monkeypatch, quantization):
    """Each layer's block is built once, after its weights are loaded, and reused; a projection replaced afterwards
    rebuilds it, and the rebuilt block equals the modules over the new weight."""
    path = make_checkpoint(tmp_path, "v3", kv_lora_rank=64, v_head_dim=16, hidden_size=64, intermediate_size=64,
                           moe_intermediate_size=64, q_lora_rank=64)
    fused, builds = _replaced_run(path, quantization)
    assert builds == [1, 1, 2]
    monkeypatch.setattr(deepseek, "fused_attention", lambda *a: None)
    modules, _ = _replaced_run(path, quantization)
    for a, b in zip(fused, modules):
        assert torch.equal(a, b)


@pytest.mark.skipif(default_policy().kernels is None, reason="latentserve's kernels do not build here")
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("file_type", ["Q6_K", "Q3_K", "Q5_0", "Q5_K", "Q4_K"])
def test_file_block_projections_run_in_the_block_as_the_modules(tmp_path, monkeypatch, threads, file_type):
    """A GGUF whose attention projections are Q6_K, Q3_K, Q5_0, Q5_K or Q4_K (inputs of 256: the k-quants'
    super-blocks): the block reads them in their `pack_*` layout and equals the modules (the block takes the steps
    of 1 and 2 tokens: its dense per-head products' limit)."""
    from gguf import GGMLQuantizationType as T

    from latentserve.layers.quant.linear import FILE_BLOCKS
    from latentserve.models.formats import gguf as gguf_format
    from tests.models.gguf_checkpoint import write_gguf

    layer = next(layer for layer in FILE_BLOCKS.values() if layer.file_type == file_type)
    monkeypatch.setattr(gguf_format, "cache_root", lambda: tmp_path / "gguf-cache")
    src = make_checkpoint(tmp_path, "v3", kv_lora_rank=64, v_head_dim=64, hidden_size=256, intermediate_size=64,
                          moe_intermediate_size=64, q_lora_rank=256)
    path = tmp_path / "model.gguf"
    projections = ("attn_q_a.", "attn_q_b.", "attn_kv_a_mqa.", "attn_output.")
    write_gguf(src, path, lambda name, t: T[file_type] if any(p in name for p in projections) else T.F32)
    calls = []
    monkeypatch.setattr(native, "mla_attention_block", lambda *a, _f=native.mla_attention_block: calls.append(
        a[3].shape[0]) or _f(*a))
    own = QuantConfig("int4" if file_type == "Q4_K" else "int8")  # the file's method: its blocks kept, the rest so
    fused = _decode_steps(path, own)
    assert {1, 2} <= set(calls)
    model = load_model(path, attn_config=AttentionConfig(block_size=4), quantization=own)
    assert all(isinstance(getattr(model.model.layers[0].self_attn, name), layer)
               for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"))
    monkeypatch.setattr(deepseek, "fused_attention", lambda *a: None)
    for a, b in zip(fused, _decode_steps(path, own)):
        assert torch.equal(a, b)
