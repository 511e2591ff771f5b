"""dots3 note (dots3_note_text) against transformers: indexed (DSA) and sliding-window MLA layers of two shapes in
its layer pattern, scaled LoRA latents, a normed rope key, a per-head output gate, wider shared experts."""
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from latentserve.models import ModelConfig
from tests.models.arch_harness import GREEDY, PROMPTS, ArchCase, llm
from tests.models.dsa_suite import DSASuite

# The real model's pattern (two indexed layers, then every fourth from the second), top-k and window below the
# prompts' lengths; the sliding layers' own heads, ranks, head dims and rope theta.
SLIDING = dict(swa_num_attention_heads=2, swa_num_key_value_heads=2, swa_q_lora_rank=64, swa_kv_lora_rank=64,
               swa_head_dim=48, swa_qk_nope_head_dim=16, swa_qk_rope_head_dim=32, swa_v_head_dim=32,
               swa_rope_theta=5000.0)
CONFIG = dict(num_hidden_layers=6, q_lora_rank=32, head_dim=32, n_group=1, topk_group=1, index_topk=8,
              index_head_dim=64, index_n_heads=16, sliding_window=5, shared_experts_intermediate_size=64,
              rope_theta=80000.0, **SLIDING)


class TestDots3Note(DSASuite):
    case = ArchCase("dots3_note_text", CONFIG, native_attention=False)

    def test_layer_shapes(self, checkpoint) -> None:
        config = llm(checkpoint).engine.runner.model.config
        assert config.layer_types == ("full_attention",) * 2 + ("sliding_attention",) * 3 + ("full_attention",)
        sliding = config.layer_config(2)
        assert (sliding.num_attention_heads, sliding.kv_lora_rank, sliding.qk_rope_head_dim, sliding.sliding_window,
                sliding.dsa, sliding.rope.theta) == (2, 64, 32, 5, None, 5000.0)
        assert config.layer_config(5) is config and config.dsa.indexer_layers == (True, True, False, False, False, True)
        # the KV pool's budget sums each layer's own width: 3 x (32 + 16) + 3 x (64 + 32)
        assert config.kv_cache_values(6) == 3 * 48 + 3 * 96 and config.layer_config(2).mla_config.kv_cache_dim == 96


    def test_mtp_tensors_are_skipped(self, checkpoint, greedy, tmp_path) -> None:
        """The real checkpoint stores its MTP layer as layer `num_hidden_layers` and `model.mtp.*`, which
        transformers does not load: neither do we, and the model runs the same."""
        path = tmp_path / "with_mtp"
        shutil.copytree(checkpoint, path)
        tensors = load_file(path / "model.safetensors")
        extra = {"model.layers.6.self_attn.q_a_proj.weight": torch.ones(32, 64),
                 "model.mtp.norm.weight": torch.ones(64)}
        save_file(tensors | extra, path / "model.safetensors", metadata={"format": "pt"})
        outputs = llm(path).generate(PROMPTS[:1], GREEDY)
        assert outputs[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


def _raw() -> dict:
    return TestDots3Note.case.transformers_config().to_dict() | {"architectures": ["Dots3NoteForCausalLM"]}


def test_bad_layer_type_is_refused() -> None:
    with pytest.raises(ValueError, match="field 'layer_types' must list one of"):
        ModelConfig.from_dict(_raw() | {"layer_types": ["linear_attention"] * 6})


def test_sliding_head_dim_must_add_up() -> None:
    raw = _raw()
    raw["per_layer_config"]["2"]["head_dim"] = 40
    with pytest.raises(ValueError, match=r"per_layer_config\[2\]: 'head_dim' must equal"):
        ModelConfig.from_dict(raw)
