"""Mistral Large 3/4 (mistral_large4, text) against transformers' MistralLarge4ForConditionalGeneration: DSA with
top-k below the prompt lengths and indexers querying from the hidden state, a NoPE layer, a layer reading an earlier
one's latent cache, the learned rope frequency and log-position query scales (randomized, as transformers
initializes them to no effect), the logit soft-cap, a dense first layer, Mistral's native tensor names as
`save_pretrained` writes them (a tiny vision tower beside, not loaded)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from latentserve.models import ModelConfig
from tests.models.arch_harness import BASE, ArchCase, llm, make_arch_checkpoint
from tests.models.dsa_suite import DSASuite

VISION = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=14,
              image_size=56, head_dim=16)
ROPE = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16, beta_fast=32.0,
            beta_slow=1.0, attention_factor=1.0)


@dataclass(frozen=True)
class Large4Case(ArchCase):
    def transformers_config(self):
        from transformers import MistralLarge4Config

        text = {k: v for k, v in {**BASE, **self.config}.items() if k not in self.drop}
        config = MistralLarge4Config(text_config=text, vision_config=VISION, tie_word_embeddings=False)
        config._attn_implementation = "eager"
        return config


def _randomize_learned_scales(path: Path) -> None:
    """transformers starts alpha at 0 and the query scaling at 0 * log + 1 (no effect): give them values."""
    file = path / "model.safetensors"
    tensors = load_file(file)
    g = torch.Generator().manual_seed(7)
    for name, t in tensors.items():
        if name == "lerope.alpha" or name.endswith("ssmax_scaling.s"):
            tensors[name] = torch.randn(t.shape, generator=g) * 0.3
        elif name.endswith("ssmax_scaling.b"):
            tensors[name] = 1 + torch.randn(t.shape, generator=g) * 0.1
    save_file(tensors, file, metadata={"format": "pt"})


class TestMistralLarge4(DSASuite):
    case = Large4Case("mistral_large4", dict(
        # 16 indexer heads: with few, a position's relu scores are often all 0, and ties rank arbitrarily
        # layer 2 reads layer 0's latent cache and layer 1's top-k
        num_hidden_layers=4, no_rope_layers=[1, 0, 1, 1], kv_source_layers=[0, 1, 0, 3],
        indexer_types=["full", "full", "shared", "full"], first_k_dense_replace=1, n_group=1, topk_group=1,
        index_topk=8, index_n_heads=16,
        index_head_dim=32, rope_parameters=ROPE, final_logit_softcapping=2.0, eos_token_id=1, bos_token_id=0),
        drop=("q_lora_rank",), native_attention=False,
        model_class="MistralLarge4ForConditionalGeneration")

    @pytest.fixture(scope="class")
    @classmethod
    def checkpoint(cls, tmp_path_factory) -> Path:
        path = make_arch_checkpoint(tmp_path_factory.mktemp(cls.case.model_type), cls.case)
        _randomize_learned_scales(path)
        return path

    def test_reading_layer_shares_its_source_cache(self, checkpoint) -> None:
        """Layer 2 attends layer 0's cache tensor, writes none of its own, and the budget holds only the owners."""
        runner = llm(checkpoint).engine.runner
        layers = runner.model.model.layers
        reader, source = layers[2].self_attn, layers[0].self_attn
        assert reader.reads_kv and not hasattr(reader, "kv_a_proj_with_mqa")
        assert reader.attn.kv_cache is source.attn.kv_cache
        latent = [n for n in runner.kv_caches if not n.endswith(".indexer")]
        assert latent == [f"model.layers.{i}.self_attn.attn" for i in (0, 1, 3)]
        assert ModelConfig.from_pretrained(checkpoint).kv_cache_values(4) == 48 + 32 + 48


def _raw(**text) -> dict:
    raw = TestMistralLarge4.case.transformers_config().to_dict() | {
        "architectures": ["MistralLarge4ForConditionalGeneration"]}
    raw["text_config"] = raw["text_config"] | text
    return raw


def test_config_reads_the_text_model() -> None:
    config = ModelConfig.from_dict(_raw())
    assert config.q_lora_rank is None and config.dsa.hidden_queries and config.dsa.index_topk == 8
    assert config.final_logit_softcapping == 2.0 and config.learned_rope_freq_scale
    assert config.log_position_query_scaling and config.mlp_layer_types == ("dense", "sparse", "sparse", "sparse")
    assert config.rope_layers == (True, False, True, True) and config.kv_sources == (0, 1, 0, 3)
    nope = config.layer_config(1)
    assert (nope.qk_rope_head_dim, nope.qk_nope_head_dim, nope.softmax_scale) == (0, 32, config.softmax_scale)
    assert config.layer_config(0) is config


@pytest.mark.parametrize("field, value, match", [
    ("no_rope_layers", [1, 2, 1, 1], "no_rope_layers"), ("kv_source_layers", [0, 1, 1, 3], "rope kind"),
    ("kv_source_layers", [0, 2, 2, 3], "kv_source_layers"),
    ("final_logit_softcapping", -1.0, "final_logit_softcapping")])
def test_unsupported_or_bad_fields_are_refused_by_name(field, value, match) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(_raw(**{field: value}))
