"""RoPE / YaRN against transformers' DeepSeek-V2 and V3 rotary code, on random inputs."""
from __future__ import annotations

import pytest
import torch
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3

from latentserve.layers.rotary import RopeConfig, RotaryEmbedding, rope_frequencies
from latentserve.models.config import ModelConfig
from tests.checkpoints import make_config

YARN_CASES = {
    "default": dict(rope_type="default", rope_theta=10000.0),
    "yarn_same_mscale": dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=128,
                             beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707),
    "yarn_mscale_ratio": dict(rope_type="yarn", rope_theta=50000.0, factor=8.0, original_max_position_embeddings=64,
                              beta_fast=16, beta_slow=2, mscale=1.0, mscale_all_dim=0.5),
    "yarn_no_mscale": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64),
    "yarn_untruncated": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
                             truncate=False, mscale=1.0, mscale_all_dim=1.0),
}


def _ours(hf_config) -> tuple[ModelConfig, RotaryEmbedding]:
    raw = hf_config.to_dict()
    raw["architectures"] = ["DeepseekV2ForCausalLM" if raw["model_type"] == "deepseek_v2" else "DeepseekV3ForCausalLM"]
    config = ModelConfig.from_dict(raw)
    return config, RotaryEmbedding(config.qk_rope_head_dim, config.rope, config.rope_style)


def _inputs(num_tokens: int = 12, heads: int = 4, dim: int = 8):
    g = torch.Generator().manual_seed(0)
    q_pe = torch.randn(num_tokens, heads, dim, generator=g)
    k_pe = torch.randn(num_tokens, dim, generator=g)
    # Far past original_max_position_embeddings, where YaRN's interpolated frequencies matter.
    positions = torch.randint(0, 4000, (num_tokens,), generator=g)
    return positions, q_pe, k_pe


def _as_hf(q_pe: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return q_pe.transpose(0, 1)[None], k_pe[None, None]  # [1, N, T, R], [1, 1, T, R]


def _from_hf(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return q[0].transpose(0, 1), k[0, 0]


@pytest.mark.parametrize("case", sorted(YARN_CASES))
def test_v2_rotary_matches_transformers(case: str) -> None:
    hf_config = make_config("v2_lite", rope_parameters=dict(YARN_CASES[case]))
    config, rotary = _ours(hf_config)
    assert rotary.style == "gptj"
    hf_rotary = hf_v2.DeepseekV2RotaryEmbedding(hf_config)
    torch.testing.assert_close(rotary.inv_freq, hf_rotary.inv_freq, rtol=0, atol=0)
    assert rotary.attention_scaling == pytest.approx(hf_rotary.attention_scaling, rel=1e-12)

    positions, q_pe, k_pe = _inputs()
    freqs_cis = hf_rotary(q_pe, positions[None])
    expected = _from_hf(*hf_v2.apply_rotary_emb(*_as_hf(q_pe, k_pe), freqs_cis))
    actual = rotary(positions, q_pe, k_pe)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-5)
    assert config.softmax_scale == pytest.approx(hf_v2.DeepseekV2Attention(hf_config, 0).scaling, rel=1e-12)


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("case", sorted(YARN_CASES))
def test_v3_rotary_matches_transformers(case: str, interleave: bool) -> None:
    hf_config = make_config("v3", rope_parameters=dict(YARN_CASES[case]), rope_interleave=interleave)
    config, rotary = _ours(hf_config)
    assert rotary.style == ("interleave" if interleave else "neox")
    hf_rotary = hf_v3.DeepseekV3RotaryEmbedding(hf_config)
    torch.testing.assert_close(rotary.inv_freq, hf_rotary.inv_freq, rtol=0, atol=0)
    assert rotary.attention_scaling == pytest.approx(hf_rotary.attention_scaling, rel=1e-12)

    positions, q_pe, k_pe = _inputs()
    cos, sin = hf_rotary(q_pe, positions[None])
    apply = hf_v3.apply_rotary_pos_emb_interleave if interleave else hf_v3.apply_rotary_pos_emb
    expected = _from_hf(*apply(*_as_hf(q_pe, k_pe), cos, sin))
    actual = rotary(positions, q_pe, k_pe)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-5)
    assert config.softmax_scale == pytest.approx(hf_v3.DeepseekV3Attention(hf_config, 0).scaling, rel=1e-12)


def test_styles_agree_on_attention_scores() -> None:
    """gptj and interleave differ only by a permutation shared by q and k, so q.k is the same."""
    rope = RopeConfig(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, mscale=1.0,
                      mscale_all_dim=0.5)
    positions, q_pe, k_pe = _inputs()
    q1, k1 = RotaryEmbedding(8, rope, "gptj")(positions, q_pe, k_pe)
    q2, k2 = RotaryEmbedding(8, rope, "interleave")(positions, q_pe, k_pe)
    scores1 = torch.einsum("tnr,sr->nts", q1, k1)
    scores2 = torch.einsum("tnr,sr->nts", q2, k2)
    torch.testing.assert_close(scores1, scores2, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(q1, q2)  # the layouts really differ


def test_rotation_is_relative() -> None:
    """Scores depend only on the position difference (a property the reference code cannot fake)."""
    rope = RopeConfig()
    rotary = RotaryEmbedding(8, rope, "neox")
    _, q_pe, k_pe = _inputs(num_tokens=1)
    q_a, k_a = rotary(torch.tensor([7]), q_pe, k_pe)
    q_b, k_b = rotary(torch.tensor([107]), q_pe, k_pe)
    k_a0 = rotary(torch.tensor([3]), q_pe, k_pe)[1]
    k_b0 = rotary(torch.tensor([103]), q_pe, k_pe)[1]
    torch.testing.assert_close(q_a[0] @ k_a0[0], q_b[0] @ k_b0[0], rtol=1e-5, atol=1e-5)


def test_yarn_keeps_high_frequencies_and_scales_low_ones() -> None:
    rope = RopeConfig(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)
    plain, _ = rope_frequencies(64, RopeConfig())
    yarn, _ = rope_frequencies(64, rope)
    assert torch.equal(yarn[0], plain[0])
    torch.testing.assert_close(yarn[-1], plain[-1] / 4)


def test_bad_rotary_arguments() -> None:
    with pytest.raises(ValueError, match="even"):
        RotaryEmbedding(7, RopeConfig(), "neox")
    with pytest.raises(ValueError, match="style"):
        RotaryEmbedding(8, RopeConfig(), "spiral")
    with pytest.raises(ValueError, match="rope_type"):
        RopeConfig(rope_type="dynamic")


@pytest.mark.parametrize("style", ["gptj", "interleave", "neox"])
@pytest.mark.parametrize("dim", [8, 64])
def test_table_rows_are_the_computed_angles(style: str, dim: int) -> None:
    """cos_sin reads a table grown to the largest position seen: each row is the angles computed for that
    position alone, to the bit, before and after the table grows."""
    rope = RopeConfig(**{k: v for k, v in YARN_CASES["yarn_mscale_ratio"].items() if k not in ("rope_type", "rope_theta")},
                      rope_type="yarn", theta=50000.0)
    rotary = RotaryEmbedding(dim, rope, style)
    for positions in (torch.tensor([0]), torch.tensor([511]), torch.arange(37) + 100, torch.tensor([5000, 3, 70000])):
        cos, sin = rotary.cos_sin(positions)
        for i, p in enumerate(positions.tolist()):
            alone = rotary._angles(torch.tensor([p]))
            assert torch.equal(cos[i], alone[0][0]) and torch.equal(sin[i], alone[1][0])
    assert rotary._table[1].shape[0] >= 70001


def test_table_follows_a_loaded_alpha() -> None:
    """A learned frequency scale loaded (or replaced) after the table was built rebuilds it."""
    rotary = RotaryEmbedding(8, RopeConfig(), "interleave", learned_freq_scale=True)
    positions = torch.tensor([3, 40])
    before = rotary.cos_sin(positions)
    with torch.no_grad():
        rotary.alpha.copy_(torch.tensor([0.5, -0.25, 0.1, 0.0]))
    after = rotary.cos_sin(positions)
    assert not torch.equal(before[0], after[0])
    assert torch.equal(after[0], rotary._angles(positions)[0]) and torch.equal(after[1], rotary._angles(positions)[1])
    rotary.alpha.data = torch.zeros(4)
    assert torch.equal(rotary.cos_sin(positions)[0], before[0])
