"""Whole DeepSeek-V2/V3 models over the paged MLA cache against transformers (fp32, eager attention)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from latentserve.config import AttentionConfig
from latentserve.layers.moe import MoE
from latentserve.models import ModelConfig, DeepseekForCausalLM, load_model
from latentserve.models.deepseek import DeepseekAttention
from tests.checkpoints import VARIANTS, load_reference, make_checkpoint
from tests.models.paged import PagedRunner

ATOL = 1e-4
PROMPT_LENS = (5, 9, 3)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("ckpt"), request.param)
    return path, load_reference(path)


def _tokens(lengths, vocab: int = 96, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _reference_logprobs(reference, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = reference(torch.tensor([tokens])).logits[0]
    return logits.float().log_softmax(-1)


def _check(actual_logits: torch.Tensor, expected_logprobs: torch.Tensor) -> None:
    # Guard against a degenerate oracle: near-uniform outputs would make any model "match".
    assert expected_logprobs.std(-1).min() > 0.3
    torch.testing.assert_close(actual_logits.log_softmax(-1), expected_logprobs, rtol=0, atol=ATOL)


def test_prefill_batch_matches_transformers(checkpoint) -> None:
    path, reference = checkpoint
    attn_config = AttentionConfig(block_size=4)
    runner = PagedRunner(load_model(path, attn_config=attn_config), attn_config)
    prompts = _tokens(PROMPT_LENS)
    logits = runner.step(list(enumerate(prompts)))
    for prompt, ours in zip(prompts, logits.split(PROMPT_LENS)):
        _check(ours, _reference_logprobs(reference, prompt))



@pytest.mark.parametrize("threads, num_seqs", [(1, 3), (2, 1), (2, 3)], indirect=["threads"])
def test_incremental_decode_matches_transformers(checkpoint, threads: int, num_seqs: int) -> None:
    path, reference = checkpoint
    attn_config = AttentionConfig(block_size=4)
    runner = PagedRunner(load_model(path, attn_config=attn_config), attn_config)
    sequences = _tokens(PROMPT_LENS[:num_seqs])
    runner.step(list(enumerate(sequences)))
    continuation = _tokens([4] * len(sequences), seed=1)
    for step in range(4):
        batch = [(r, [continuation[r][step]]) for r in range(len(sequences))]
        logits = runner.step(batch)
        for r, seq in enumerate(sequences):
            seq.append(continuation[r][step])
            _check(logits[r : r + 1], _reference_logprobs(reference, seq)[-1:])


def test_chunked_prefill_in_a_mixed_batch_matches_transformers(checkpoint) -> None:
    """A decode next to a prefill whose context (from an earlier chunk) is read back in several workspace chunks."""
    path, reference = checkpoint
    attn_config = AttentionConfig(block_size=4, workspace_tokens=4)
    runner = PagedRunner(load_model(path, attn_config=attn_config), attn_config)
    short, long = _tokens([6, 11], seed=2)
    runner.step([(0, short), (1, long[:7])])
    extra = _tokens([1], seed=3)[0]
    logits = runner.step([(0, extra), (1, long[7:])])
    _check(logits[:1], _reference_logprobs(reference, short + extra)[-1:])
    _check(logits[1:], _reference_logprobs(reference, long)[7:])


@pytest.mark.parametrize("variant, overrides", [
    ("v2_lite", dict(attention_bias=True, mlp_bias=True)),
    ("v3", dict(attention_bias=True, first_k_dense_replace=2, num_hidden_layers=3)),
])
def test_biases_and_deeper_models_match_transformers(tmp_path, variant: str, overrides: dict) -> None:
    path = make_checkpoint(tmp_path, variant, **overrides)
    reference = load_reference(path)
    attn_config = AttentionConfig(block_size=4)
    runner = PagedRunner(load_model(path, attn_config=attn_config), attn_config)
    prompts = _tokens(PROMPT_LENS)
    logits = runner.step(list(enumerate(prompts)))
    for prompt, ours in zip(prompts, logits.split(PROMPT_LENS)):
        _check(ours, _reference_logprobs(reference, prompt))


def test_model_structure_follows_the_config(tmp_path) -> None:
    path = make_checkpoint(tmp_path, "v2_lite")
    model = load_model(path)
    config = model.config
    assert model.attention_layer_names == [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    assert list(model.static_forward_context) == model.attention_layer_names
    assert model.mla_config.num_heads == 4 and model.mla_config.kv_cache_dim == 16 + 8
    layers = model.model.layers
    assert not isinstance(layers[0].mlp, MoE) and isinstance(layers[1].mlp, MoE)  # first_k_dense_replace=1
    assert isinstance(layers[0].self_attn, DeepseekAttention) and layers[0].self_attn.q_lora is False
    assert config.softmax_scale == pytest.approx(16**-0.5 * (0.1 * 0.707 * math.log(4.0) + 1) ** 2)


def test_moe_layer_freq_makes_every_other_layer_dense(tmp_path) -> None:
    path = make_checkpoint(tmp_path, "v3", num_hidden_layers=4)
    raw = json.loads((path / "config.json").read_text())
    raw["moe_layer_freq"] = 2
    model = DeepseekForCausalLM(ModelConfig.from_dict(raw))
    assert [isinstance(layer.mlp, MoE) for layer in model.model.layers] == [False, False, True, False]


def test_bf16_model_keeps_router_in_fp32(tmp_path) -> None:
    path = make_checkpoint(tmp_path, "v3")
    model = load_model(path, dtype=torch.bfloat16)
    moe = model.model.layers[1].mlp
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert moe.experts[0].gate_proj.weight.dtype == torch.bfloat16
    assert moe.gate.weight.dtype == torch.float32 and moe.gate.e_score_correction_bias.dtype == torch.float32
    assert model.model.rotary_embs[0].inv_freq.dtype == torch.float32


def test_forward_rejects_bad_inputs(tmp_path) -> None:
    model = load_model(make_checkpoint(tmp_path, "v3_nonorm"))
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="positions"):
        model(torch.zeros(3, dtype=torch.long), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="dtype"):
        DeepseekForCausalLM(model.config, dtype=torch.int32)
