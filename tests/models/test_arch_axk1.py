"""A.X K1 (axk1) against transformers: an RMSNorm on the MoE output (the one-call MoE block applies it too),
four routing groups of which two are kept, q LoRA, YaRN."""
import torch
from safetensors.torch import load_file, save_file

from latentserve.models import ModelConfig, load_model
from latentserve.models.loader import SINGLE_FILE
from tests.models.arch_harness import (
    GREEDY, PROMPTS, YARN, ArchCase, ArchSuite, llm, make_arch_checkpoint, prompt_logprobs,
)


class TestAXK1(ArchSuite):
    case = ArchCase("axk1", dict(q_lora_rank=32, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                 mlp_layer_types=["dense", "sparse", "sparse"], rope_parameters=YARN))


def test_published_layout_loads(tmp_path) -> None:
    """As published: the norm stored for dense layers too (unused), no score correction bias (zero)."""
    path = make_arch_checkpoint(tmp_path, TestAXK1.case)
    tensors = load_file(path / SINGLE_FILE)
    tensors["model.layers.0.post_mlp_layernorm.weight"] = torch.full((64,), 7.0)
    for name in [n for n in tensors if n.endswith("e_score_correction_bias")]:
        tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, path / SINGLE_FILE, metadata={"format": "pt"})
    zero_bias = llm(path).generate(PROMPTS, GREEDY)
    for name in [n for n in tensors if n.endswith("e_score_correction_bias")]:
        del tensors[name]
    save_file(tensors, path / SINGLE_FILE, metadata={"format": "pt"})
    model = load_model(path)
    assert not hasattr(model.model.layers[0].mlp, "post_mlp_layernorm")
    assert torch.equal(model.model.layers[1].mlp.gate.e_score_correction_bias, torch.zeros(8))
    no_bias = llm(path).generate(PROMPTS, GREEDY)
    for a, b in zip(zero_bias, no_bias):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and prompt_logprobs(a) == prompt_logprobs(b)


def test_layer_kinds_without_mlp_layer_types() -> None:
    """transformers derives them from first_k_dense_replace (default 1) and moe_layer_freq."""
    raw = TestAXK1.case.transformers_config().to_dict() | {"architectures": ["AXK1ForCausalLM"]}
    del raw["mlp_layer_types"]
    assert ModelConfig.from_dict(raw).mlp_layer_types == ("dense", "sparse", "sparse")
    config = ModelConfig.from_dict(raw | {"first_k_dense_replace": 0, "moe_layer_freq": 2})
    assert config.mlp_layer_types == ("sparse", "dense", "sparse") and config.moe_output_norm
