"""MiniCPM3 (minicpm3) against transformers: dense, LongRoPE on rotate-half rope dims, scaled embeddings, residuals
and logits, tied head. Its layers scale their residuals, so the one-call decode blocks decline them."""
import math

import pytest
import torch

from latentserve.layers.rotary import RotaryEmbedding
from latentserve.models import ModelConfig
from tests.models.arch_harness import ArchCase, ArchSuite

_FACTORS = dict(short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5],
                long_factor=[1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0])
LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=64, **_FACTORS)


class TestMiniCPM3(ArchSuite):
    case = ArchCase("minicpm3", dict(q_lora_rank=32, tie_word_embeddings=True, scale_emb=12, scale_depth=1.4,
                                     dim_model_base=32, rope_parameters=LONGROPE),
                    drop=("n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size"),
                    native_attention=False, native_moe=False)


def _raw(**overrides) -> dict:
    raw = TestMiniCPM3.case.transformers_config().to_dict() | {"architectures": ["MiniCPM3ForCausalLM"]}
    return raw | overrides


def test_scales_follow_the_config() -> None:
    config = ModelConfig.from_dict(_raw())
    assert config.embedding_scale == 12.0 and config.logits_scaling == 64 / 32
    assert config.residual_scale == pytest.approx(1.4 / math.sqrt(3)) and config.rope_style == "neox"
    unscaled = ModelConfig.from_dict(_raw(scale_depth=None, dim_model_base=None))
    assert unscaled.residual_scale == pytest.approx(1.0) and unscaled.logits_scaling == 1.0
    with pytest.raises(ValueError, match="long_factor"):
        ModelConfig.from_dict(_raw(rope_parameters={**LONGROPE, "long_factor": [1.0] * 7}))


@pytest.mark.parametrize("max_positions, positions", [(256, [0, 5, 63]), (256, [64, 100, 255]), (64, [3, 60])])
def test_longrope_matches_transformers(max_positions: int, positions: list[int]) -> None:
    """Short factors within the original context, long ones past it, and the attention factor on cos and sin (none
    where the context is not extended)."""
    from transformers.models.minicpm3.modeling_minicpm3 import MiniCPM3RotaryEmbedding

    hf_config = TestMiniCPM3.case.transformers_config()
    hf_config.max_position_embeddings = max_positions
    config = ModelConfig.from_dict(hf_config.to_dict() | {"architectures": ["MiniCPM3ForCausalLM"]})
    ours = RotaryEmbedding(config.qk_rope_head_dim, config.rope, config.rope_style)
    theirs = MiniCPM3RotaryEmbedding(hf_config)
    ids = torch.tensor(positions)
    cos, sin = theirs(torch.zeros(1), ids[None])
    our_cos, our_sin = ours.cos_sin(ids)
    torch.testing.assert_close(our_cos, cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(our_sin.abs(), sin[0].abs(), rtol=0, atol=1e-6)
