"""GLM-5 next (glm5_next), its language model on text, against transformers' whole model given text only: KDA layers
and NoPE sparse-MLA layers with the k-pool indexer, mHC streams, clamped SwiGLU everywhere; its checkpoint has the
vision tower, which is skipped."""
import json
import shutil
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file, save_file

from latentserve.models import ModelConfig
from latentserve.models.loader import SINGLE_FILE
from tests.models.arch_harness import (BASE, GREEDY, MAX_TOKENS, PROMPTS, ArchCase, llm, make_arch_checkpoint,
                                       prompt_logprobs)
from tests.models.dsa_suite import DSASuite

# The real model's pattern (three KDA layers to one MLA layer, the first three layers dense) on 8 layers; the
# indexer picks 2 pools of 4 (+ a tail of up to 3), below the prompts' lengths.
GLM5_NEXT = dict(num_hidden_layers=8, q_lora_rank=32, qk_rope_head_dim=0, index_topk=8, index_kpool=4,
                 index_head_dim=16, index_n_heads=4, linear_num_heads=2, linear_head_dim=32, hc_mult=4,
                 swiglu_limit=0.5, pad_token_id=None)


@dataclass(frozen=True)
class VLCase(ArchCase):
    """The config: the text model's fields in `text_config`, a one-layer vision tower."""

    def transformers_config(self):
        from transformers import AutoConfig

        vision = dict(hidden_size=32, intermediate_size=64, depth=1, num_heads=2, out_hidden_size=64,
                      projection_intermediate_size=64)
        fields = {k: v for k, v in {**BASE, **self.config}.items() if k not in self.drop}
        config = AutoConfig.for_model("glm5_next", text_config=fields, vision_config=vision,
                                      tie_word_embeddings=False)
        config._attn_implementation = "eager"
        return config


class TestGlm5Next(DSASuite):
    case = VLCase("glm5_next", GLM5_NEXT, native_attention=False, native_moe=False,
                  model_class="Glm5NextForConditionalGeneration", int4_error=0.6)

    @pytest.fixture(scope="class")
    @classmethod
    def checkpoint(cls, tmp_path_factory):
        """transformers initializes the mHC biases to 0 and scales to 1, the pools' position bias to 0 and their gate
        to 1: randomize them, so that a model ignoring them would not match."""
        path = make_arch_checkpoint(tmp_path_factory.mktemp(cls.case.model_type), cls.case)
        tensors = load_file(path / SINGLE_FILE)
        g = torch.Generator().manual_seed(5)
        for name, tensor in tensors.items():
            if name.endswith(("_base", "index_kpool_compress_ape")):
                tensor.copy_(torch.randn(tensor.shape, generator=g))
            elif name.endswith("_scale"):
                tensor.copy_(torch.rand(tensor.shape, generator=g) + 0.5)
            elif name.endswith("index_kpool_compress_gate"):
                tensor.copy_(torch.randn(tensor.shape, generator=g) * 0.5)
        save_file(tensors, path / SINGLE_FILE, metadata={"format": "pt"})
        return path

    def test_the_clamp_binds(self, checkpoint, greedy, tmp_path) -> None:
        """Without the clamp the model's output changes: the tests above exercise it."""
        path = shutil.copytree(checkpoint, tmp_path / "unclamped")
        config = json.loads((path / "config.json").read_text())
        config["text_config"]["swiglu_limit"] = 0.0  # 0: no clamp
        (path / "config.json").write_text(json.dumps(config))
        unclamped = llm(path).generate(PROMPTS, GREEDY)
        assert any(abs(a - b) > 1e-3 for x, y in zip(greedy, unclamped)
                   for a, b in zip(prompt_logprobs(x), prompt_logprobs(y)))

    def test_layer_pattern(self, checkpoint) -> None:
        model = llm(checkpoint).engine.runner.model
        assert model.config.layer_types == (("linear_attention",) * 3 + ("full_attention",)) * 2
        assert model.attention_layer_names == ["model.layers.3.self_attn.attn", "model.layers.7.self_attn.attn"]
        assert model.config.mlp_layer_types == ("dense",) * 3 + ("sparse",) * 5

    def test_prefix_cache_hit_matches(self, checkpoint) -> None:
        """(The DSA suite's check: a hybrid's linear-attention state cannot resume from a cached block, so prefix
        caching is refused.)"""
        with pytest.raises(ValueError, match="enable_prefix_caching=True: glm5_next has linear-attention layers"):
            llm(checkpoint, enable_prefix_caching=True)

    def test_decode_matches_transformers_generate(self, checkpoint, greedy) -> None:
        """transformers' own cached decode (KDA states, the indexer's pooled cache) continues the prompts as ours."""
        reference = self.case.reference(checkpoint)
        reference.generation_config.eos_token_id = None  # ours ran past EOS (ignore_eos)
        for prompt, out in zip(PROMPTS, greedy):
            expected = reference.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
            assert out.outputs[0].token_ids == expected[0, len(prompt):].tolist()

    def test_saved_int8_model_runs_the_same(self, checkpoint, tmp_path) -> None:
        """Its own tensors (mHC, the pools' parameters, the KDA layers' fp32 ones) survive save_quantized."""
        engine = llm(checkpoint, quantization="int8")
        before = engine.generate(PROMPTS, GREEDY)
        after = llm(engine.save_quantized(tmp_path / "saved")).generate(PROMPTS, GREEDY)
        for a, b in zip(before, after):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids and prompt_logprobs(a) == prompt_logprobs(b)

    def test_the_vision_tower_is_in_the_checkpoint(self, checkpoint) -> None:
        assert any(name.startswith("model.visual.") for name in load_file(checkpoint / SINGLE_FILE))


def _raw(**overrides) -> dict:
    raw = TestGlm5Next.case.transformers_config().to_dict() | {"architectures": ["Glm5NextForConditionalGeneration"]}
    raw["text_config"] = {k: v for k, v in (raw["text_config"] | overrides).items() if v is not None}
    return raw


def test_config_defaults_and_errors() -> None:
    config = ModelConfig.from_dict(_raw(layer_types=None, mlp_layer_types=None))
    assert config.layer_types == (("linear_attention",) * 3 + ("full_attention",)) * 2
    assert config.dsa.index_kpool == 4 and config.dsa.width == 11 and config.dsa.cache_dim == 32
    assert config.hyper_connections.sinkhorn_iters == 20 and config.swiglu_limit_everywhere
    assert config.linear_attention.gate_lower_bound == -5.0
    with pytest.raises(ValueError, match="index_kpool"):
        ModelConfig.from_dict(_raw(index_kpool=3))
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        ModelConfig.from_dict(_raw(qk_rope_head_dim=16))
    with pytest.raises(ValueError, match="index_kpool_always_select_tail"):
        ModelConfig.from_dict(_raw(index_kpool_always_select_tail=False))
    with pytest.raises(ValueError, match="text_config"):
        ModelConfig.from_dict({"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next"})
