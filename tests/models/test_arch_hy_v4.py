"""Hunyuan V4 (hy_v4) against transformers: DSA with top-k below the prompt lengths, the second layer sharing the
first's selection, the tail-rope indexer, learned attention sinks (random, not the zero init), the output gate from
the layer's input, four hyper-connected residual streams, routed experts clamped at a limit the tiny model reaches,
the first layer dense. The checkpoint is transformers' native layout (stacked experts, `linear_gate`, `hc_pre.*`)."""
import json
import shutil
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file, save_file

from latentserve import LLM
from latentserve.models import ModelConfig
from latentserve.models.loader import SINGLE_FILE
from tests.models.arch_harness import BASE, GREEDY, PROMPTS, ArchCase, llm, make_arch_checkpoint, prompt_logprobs
from tests.models.dsa_suite import DSASuite


def _checkpoint(root, case):
    """transformers initializes the sinks to zero and the hyper-connection scales to 0.01: randomize both, so that
    a model ignoring them would not match."""
    path = make_arch_checkpoint(root, case)
    tensors = load_file(path / SINGLE_FILE)
    g = torch.Generator().manual_seed(5)
    for name, tensor in tensors.items():
        if name.endswith("learnable_sink_param"):
            tensor.copy_(torch.randn(tensor.shape, generator=g) * 2)
        elif name.endswith("hc_scale"):
            tensor.copy_(torch.rand(tensor.shape, generator=g) + 0.5)
    save_file(tensors, path / SINGLE_FILE, metadata={"format": "pt"})
    return path


HY_V4 = dict(
    q_lora_rank=32, mlp_layer_types=["dense", "sparse", "sparse"], routed_scaling_factor=2.5, norm_topk_prob=True,
    rope_parameters=dict(rope_type="default", rope_theta=1e4), index_topk=8, index_n_heads=16, index_head_dim=32,
    indexer_types=["full", "shared", "full"], hc_mult=4, swiglu_limit=0.5)


class TestHYV4(DSASuite):
    case = ArchCase("hy_v4", HY_V4, native_attention=False, native_moe=False)

    @pytest.fixture(scope="class")
    @classmethod
    def checkpoint(cls, tmp_path_factory):
        return _checkpoint(tmp_path_factory.mktemp(cls.case.model_type), cls.case)

    def test_the_clamp_binds(self, checkpoint, greedy, tmp_path) -> None:
        """Without the clamp the model's output changes: the tests above exercise it."""
        path = shutil.copytree(checkpoint, tmp_path / "unclamped")
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(config | {"swiglu_limit": 0.0}))  # 0: no clamp
        unclamped = llm(path).generate(PROMPTS, GREEDY)
        assert any(abs(a - b) > 1e-3 for x, y in zip(greedy, unclamped)
                   for a, b in zip(prompt_logprobs(x), prompt_logprobs(y)))


@dataclass(frozen=True)
class VLCase(ArchCase):
    """The VL model's config: the text model's fields in `text_config`, a one-layer vision tower."""

    def transformers_config(self):
        from transformers import AutoConfig

        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      out_hidden_size=64)
        config = AutoConfig.for_model("hy_v4_vl", text_config={**BASE, **self.config}, vision_config=vision,
                                      tie_word_embeddings=False)
        config._attn_implementation = "eager"
        return config

    def test_saved_quantized_model_runs_the_same(self, checkpoint, tmp_path) -> None:
        """Its own tensors (hyper-connections, sinks, the clamped experts' layers) survive save_quantized."""
        engine = llm(checkpoint, quantization="int8")
        before = engine.generate(PROMPTS, GREEDY)
        after = llm(engine.save_quantized(tmp_path / "saved")).generate(PROMPTS, GREEDY)
        for a, b in zip(before, after):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids and prompt_logprobs(a) == prompt_logprobs(b)


class TestHYV4VL(DSASuite):
    """The VL model's language model on text, against transformers' whole VL model given text only (its MRoPE then
    rotates by the token positions); its checkpoint has the vision tower, which is skipped."""
    case = VLCase("hy_v4_vl", {**HY_V4, "rope_parameters": dict(rope_type="default", rope_theta=1e4,
                                                                mrope_section=[4, 2, 2])},
                  native_attention=False, native_moe=False, model_class="HYV4VLForConditionalGeneration")

    @pytest.fixture(scope="class")
    @classmethod
    def checkpoint(cls, tmp_path_factory):
        return _checkpoint(tmp_path_factory.mktemp(cls.case.model_type), cls.case)

    def test_the_vision_tower_is_in_the_checkpoint(self, checkpoint) -> None:
        assert any(name.startswith("vit.") for name in load_file(checkpoint / SINGLE_FILE))


def _raw(**overrides) -> dict:
    raw = TestHYV4.case.transformers_config().to_dict() | {"architectures": ["HYV4ForCausalLM"]}
    return {k: v for k, v in (raw | overrides).items() if v is not None}


def test_config_defaults_and_errors() -> None:
    config = ModelConfig.from_dict(_raw(indexer_types=None, num_hidden_layers=6, mlp_layer_types=None))
    assert config.dsa.indexer_layers == (True, True, False, False, False, True)
    assert config.mlp_layer_types == ("dense",) + ("sparse",) * 5
    assert config.dsa.attention_sinks and config.dsa.rope_tail and config.hyper_connections.streams == 4
    assert ModelConfig.from_dict(_raw(swiglu_limit=-1.0)).swiglu_limit is None
    with pytest.raises(ValueError, match="hc_mult"):
        ModelConfig.from_dict(_raw(hc_mult=0))
    with pytest.raises(ValueError, match="indexer_types"):
        ModelConfig.from_dict(_raw(indexer_types=["full", "dense", "full"]))


def test_speculative_decoding_is_refused(tmp_path) -> None:
    """Its MTP layers are not loaded: asking for MTP drafts is a clear error."""
    path = make_arch_checkpoint(tmp_path, TestHYV4.case)
    with pytest.raises(ValueError, match="MTP"):
        LLM(model=str(path), dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": 1})


def test_vl_config_needs_its_text_config() -> None:
    with pytest.raises(ValueError, match="text_config"):
        ModelConfig.from_dict({"architectures": ["HYV4VLForConditionalGeneration"], "model_type": "hy_v4_vl"})
    raw = TestHYV4VL.case.transformers_config().to_dict() | {"architectures": ["HYV4VLForConditionalGeneration"]}
    config = ModelConfig.from_dict(raw)
    assert config.model_type == "hy_v4_vl" and config.dsa.index_n_heads == 16 and config.hyper_connections
