"""Mistral Large 4's small capabilities against transformers' own modules (modeling_mistral_large4): the learned
rope frequency scale, the learned log-position query scaling, and the logit soft-cap on a real model's logits."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers.models.mistral_large4 import modeling_mistral_large4 as hf
from transformers.models.mistral_large4.configuration_mistral_large4 import MistralLarge4TextConfig

from latentserve.layers.logit_softcap import check_softcap, softcap
from latentserve.layers.query_scaling import LogPositionQueryScaling, log_positions
from latentserve.layers.rotary import RopeConfig, RotaryEmbedding
from latentserve.models.config import ModelConfig
from latentserve.models.deepseek import DeepseekForCausalLM
from latentserve.models.mla_attention import scale_queries
from tests.checkpoints import make_config

ROPE = dict(rope_type="yarn", rope_theta=10000.0, factor=16.0, original_max_position_embeddings=32, beta_fast=32.0,
            beta_slow=1.0, attention_factor=1.0)
# ours, the same
_ROPE = RopeConfig(theta=10000.0, rope_type="yarn", factor=16.0, original_max_position_embeddings=32,
                   attention_factor=1.0)


def _hf_text_config() -> MistralLarge4TextConfig:
    return MistralLarge4TextConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, qk_rope_head_dim=8,
                                   qk_nope_head_dim=8, rope_parameters=dict(ROPE), vocab_size=128)


def test_learned_rope_frequency_scale_matches_transformers():
    g = torch.Generator().manual_seed(0)
    reference = hf.MistralLarge4TextRotaryEmbedding(_hf_text_config())
    ours = RotaryEmbedding(8, _ROPE, "interleave", learned_freq_scale=True)
    with torch.no_grad():
        reference.alpha.copy_(torch.randn(4, generator=g) * 0.5)
        ours.alpha.copy_(reference.alpha)
    positions = torch.randint(0, 2000, (10,), generator=g)
    q = torch.randn(10, 4, 8, generator=g)
    cos, sin = reference(q, positions[None])
    expected, _ = hf.apply_rotary_pos_emb_interleave(q.transpose(0, 1)[None], None, cos, sin)
    c, s = ours.cos_sin(positions)
    torch.testing.assert_close(ours.rotate(q, c[:, None], s[:, None]), expected[0].transpose(0, 1),
                               rtol=1e-5, atol=1e-5)
    # alpha is what moves the angles: without it the rotation differs.
    plain = RotaryEmbedding(8, _ROPE, "interleave")
    assert plain.alpha is None
    assert not torch.allclose(plain.cos_sin(positions)[0], c)


def test_log_position_query_scaling_matches_transformers():
    g = torch.Generator().manual_seed(1)
    reference = hf.MistralLarge4TextSoftmaxScaling(4)
    ours = LogPositionQueryScaling(4)
    with torch.no_grad():
        reference.scale.copy_(torch.randn(4, generator=g))
        reference.bias.copy_(torch.randn(4, generator=g))
        ours.load_state_dict(reference.state_dict())
    positions = torch.randint(0, 100000, (7,), generator=g)
    q = torch.randn(7, 4, 16, generator=g)
    expected = reference(q[None], positions[None], head_dim_first=False)[0]
    torch.testing.assert_close(scale_queries(q, ours(log_positions(positions))), expected, rtol=1e-6, atol=1e-6)


def test_softcap_caps_the_model_logits():
    config = ModelConfig.from_dict({**make_config("v3").to_dict(), "architectures": ["DeepseekV3ForCausalLM"]})
    torch.manual_seed(0)
    model = DeepseekForCausalLM(config)
    capped = DeepseekForCausalLM(replace(config, final_logit_softcapping=0.5))
    capped.load_state_dict(model.state_dict())
    hidden = torch.randn(5, config.hidden_size) * 10
    plain = model.compute_logits(hidden)
    assert plain.abs().max() > 0.5  # the cap has something to do
    got = capped.compute_logits(hidden)
    # transformers' MistralLarge4ForConditionalGeneration: logits / cap, tanh, * cap
    torch.testing.assert_close(got, torch.tanh(plain / 0.5) * 0.5)
    assert got.abs().max() <= 0.5
    assert softcap(plain, None) is plain


@pytest.mark.parametrize("cap", [0, -1.0, "30", True])
def test_bad_softcap_is_refused(cap):
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        check_softcap(cap)
