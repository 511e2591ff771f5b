"""`ModelConfig` parsing: transformers-written configs, DeepSeek's original ones, and bad input."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3

from latentserve.layers.quant.config import Fp8Config
from latentserve.layers.rotary import RotaryEmbedding
from latentserve.models import ModelConfig
from tests.checkpoints import make_config

# DeepSeek-V2-Lite's config.json as DeepSeek published it (remote-code era field names).
LEGACY_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "attention_bias": False,
    "aux_loss_alpha": 0.001, "bos_token_id": 100000, "eos_token_id": 100001, "ep_size": 1,
    "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64,
    "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6,
    "num_hidden_layers": 27, "num_key_value_heads": 16, "pretraining_tp": 1, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 102400,
}

# DeepSeek-V3's, as a bf16 conversion ships it (the original also has an fp8 quantization_config).
LEGACY_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
    "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280,
}


def _saved_dict(hf_config, tmp_path) -> dict:
    hf_config.architectures = [
        "DeepseekV2ForCausalLM" if hf_config.model_type == "deepseek_v2" else "DeepseekV3ForCausalLM"
    ]
    hf_config.save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


def test_transformers_v2_config(tmp_path) -> None:
    config = ModelConfig.from_dict(_saved_dict(make_config("v2_group"), tmp_path))
    assert config.model_type == "deepseek_v2" and config.rope_style == "gptj"
    assert config.q_lora_rank == 24 and config.kv_lora_rank == 16 and config.qk_head_dim == 16
    assert config.routing.topk_method == "group_limited_greedy" and config.routing.scoring_func == "softmax"
    assert (config.routing.n_group, config.routing.topk_group) == (4, 2)
    assert config.routing.routed_scaling_factor == 2.0 and config.n_shared_experts == 2
    assert config.rope.rope_type == "yarn" and config.rope.mscale_all_dim == 0.5
    assert [config.is_moe_layer(i) for i in range(2)] == [True, True]


def test_transformers_v3_config(tmp_path) -> None:
    config = ModelConfig.from_dict(_saved_dict(make_config("v3_nonorm"), tmp_path))
    assert config.model_type == "deepseek_v3" and config.rope_style == "neox"
    assert config.q_lora_rank is None
    assert config.routing.scoring_func == "sigmoid" and config.routing.topk_method == "noaux_tc"
    assert config.routing.norm_topk_prob is False and config.routing.routed_scaling_factor == 1.5
    assert config.rope.rope_type == "default" and config.num_nextn_predict_layers == 1


@pytest.mark.parametrize("legacy, hf_cls, hf_module", [
    (LEGACY_V2_LITE, DeepseekV2Config, hf_v2), (LEGACY_V3, DeepseekV3Config, hf_v3),
])
def test_original_deepseek_configs_match_transformers_reading(legacy, hf_cls, hf_module) -> None:
    """transformers reads `rope_scaling` + `rope_theta` too; the rope and softmax scale must agree with it."""
    config = ModelConfig.from_dict(legacy)
    hf_config = hf_cls(**legacy)
    rotary = RotaryEmbedding(config.qk_rope_head_dim, config.rope, config.rope_style)
    v2 = hf_cls is DeepseekV2Config
    hf_rotary = (hf_module.DeepseekV2RotaryEmbedding if v2 else hf_module.DeepseekV3RotaryEmbedding)(hf_config)
    torch.testing.assert_close(rotary.inv_freq, hf_rotary.inv_freq, rtol=0, atol=0)
    assert rotary.attention_scaling == pytest.approx(hf_rotary.attention_scaling)
    hf_scale = hf_module.yarn_apply_mscale(hf_config.rope_parameters, hf_config.qk_head_dim**-0.5)
    assert config.softmax_scale == pytest.approx(hf_scale, rel=1e-12)
    assert config.rope.factor == 40 and config.rope.original_max_position_embeddings == 4096
    assert config.routing.n_routed_experts == legacy["n_routed_experts"]
    assert config.first_k_dense_replace == legacy["first_k_dense_replace"]


def test_legacy_v3_defaults() -> None:
    config = ModelConfig.from_dict(LEGACY_V3)
    assert config.rope_style == "interleave"  # DeepSeek's own checkpoints store interleaved rope dims
    assert config.routing.topk_method == "noaux_tc" and config.num_nextn_predict_layers == 1
    assert config.mla_config.kv_cache_dim == 576


def test_yarn_factor_defaults_to_the_context_ratio() -> None:
    raw = dict(LEGACY_V2_LITE, rope_scaling={"type": "yarn", "original_max_position_embeddings": 4096})
    assert ModelConfig.from_dict(raw).rope.factor == 163840 / 4096


def test_dense_only_model_without_routed_experts() -> None:
    raw = {k: v for k, v in LEGACY_V2_LITE.items() if k != "n_routed_experts"}
    config = ModelConfig.from_dict(raw)
    assert config.routing is None and not any(config.is_moe_layer(i) for i in range(27))


def _bad(**changes) -> dict:
    raw = dict(LEGACY_V2_LITE)
    for key, value in changes.items():
        if value is _DROP:
            raw.pop(key)
        else:
            raw[key] = value
    return raw


_DROP = object()


@pytest.mark.parametrize("raw, field", [
    (_bad(architectures=["LlamaForCausalLM"]), "architectures"),
    (_bad(architectures=_DROP), "architectures"),
    (_bad(architectures=["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"]), "architectures"),
    (_bad(model_type="deepseek_v3"), "model_type"),
    (_bad(hidden_size=_DROP), "hidden_size"),
    (_bad(hidden_size="2048"), "hidden_size"),
    (_bad(num_hidden_layers=True), "num_hidden_layers"),
    (_bad(q_lora_rank=0), "q_lora_rank"),
    (_bad(kv_lora_rank=None), "kv_lora_rank"),
    (_bad(qk_rope_head_dim=63), "qk_rope_head_dim"),
    (_bad(topk_method="fancy"), "topk_method"),
    (_bad(scoring_func="sigmoid"), "topk_method"),
    (_bad(topk_method="group_limited_greedy", n_group=None), "n_group"),
    (_bad(num_experts_per_tok=_DROP), "num_experts_per_tok"),
    (_bad(norm_topk_prob="yes"), "norm_topk_prob"),
    (_bad(routed_scaling_factor=0), "routed_scaling_factor"),
    (_bad(hidden_act="gelu"), "hidden_act"),
    (_bad(quantization_config={"quant_method": "bitsandbytes"}),
     "quantization_config: field 'quant_method' is 'bitsandbytes'"),
    (_bad(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_type"),
    (_bad(rope_scaling="yarn"), "rope_scaling"),
    (_bad(rope_scaling={"type": "yarn", "factor": "big"}), "factor"),
    (_bad(rope_scaling={"type": "yarn", "factor": 2.0, "partial_rotary_factor": 0.5}), "partial_rotary_factor"),
])
def test_bad_configs_name_the_field(raw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_dict(raw)


def test_fp8_quantization_config_as_deepseek_publishes_it() -> None:
    fp8 = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[128, 128])
    assert ModelConfig.from_dict({**LEGACY_V3, "quantization_config": fp8}).quantization == Fp8Config((128, 128))
    assert ModelConfig.from_dict(LEGACY_V3).quantization is None


def test_config_must_be_an_object() -> None:
    with pytest.raises(ValueError, match="JSON object"):
        ModelConfig.from_dict([1, 2])


def test_unknown_architecture_lists_the_registry() -> None:
    from latentserve.models.arch import ARCHITECTURES

    with pytest.raises(ValueError, match="supported") as error:
        ModelConfig.from_dict({**LEGACY_V3, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    assert all(model_type in str(error.value) for model_type in ARCHITECTURES)
    with pytest.raises(ValueError, match="SarvamMLAForCausalLM"):
        ModelConfig.from_dict({k: v for k, v in LEGACY_V3.items() if k != "model_type"} | {
            "architectures": ["LlamaForCausalLM"]})


def test_model_type_picks_the_adapter_where_architectures_are_shared() -> None:
    """transformers saves Sarvam as DeepseekV3ForCausalLM with model_type sarvam_mla; its first configs call YaRN
    'deepseek_yarn'."""
    yarn = {"type": "deepseek_yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    config = ModelConfig.from_dict({**LEGACY_V3, "model_type": "sarvam_mla", "rope_scaling": yarn})
    assert config.model_type == "sarvam_mla" and config.architecture == "DeepseekV3ForCausalLM"
    assert config.rope.rope_type == "yarn" and config.rope.factor == 4.0
    with pytest.raises(ValueError, match="model_type 'deepseek_v2' needs"):
        ModelConfig.from_dict({**LEGACY_V3, "model_type": "deepseek_v2"})


def test_kimi_k2_is_deepseek_v3_under_its_own_model_type() -> None:
    config = ModelConfig.from_dict({**LEGACY_V3, "model_type": "kimi_k2"})
    v3 = ModelConfig.from_dict(LEGACY_V3)
    assert config.model_type == "kimi_k2" and config.routing == v3.routing and config.rope_style == v3.rope_style
