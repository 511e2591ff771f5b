"""GLM-4.7-Flash (glm4_moe_lite) against transformers: layer kinds from mlp_layer_types (a dense layer after a sparse
one), v_head_dim twice qk_nope_head_dim, q LoRA, one routing group, plain RoPE at GLM's theta."""
import pytest

from latentserve.models import ModelConfig
from tests.models.arch_harness import ArchCase, ArchSuite


class TestGlm4MoeLite(ArchSuite):
    case = ArchCase("glm4_moe_lite", dict(
        q_lora_rank=32, v_head_dim=32, mlp_layer_types=["dense", "sparse", "dense"], n_group=1, topk_group=1,
        routed_scaling_factor=1.8, norm_topk_prob=True, rope_parameters=dict(rope_type="default", rope_theta=1e6)))


def _raw(**overrides) -> dict:
    raw = TestGlm4MoeLite.case.transformers_config().to_dict() | {"architectures": ["Glm4MoeLiteForCausalLM"]}
    return {k: v for k, v in (raw | overrides).items() if v is not None}


def test_layer_kinds_follow_mlp_layer_types() -> None:
    assert [ModelConfig.from_dict(_raw()).is_moe_layer(i) for i in range(3)] == [False, True, False]
    # A config without the list: transformers' default, the first layer dense.
    assert ModelConfig.from_dict(_raw(mlp_layer_types=None)).mlp_layer_types == ("dense", "sparse", "sparse")
    with pytest.raises(ValueError, match="mlp_layer_types"):
        ModelConfig.from_dict(_raw(mlp_layer_types=["dense", "moe", "dense"]))
    with pytest.raises(ValueError, match="mlp_layer_types"):
        ModelConfig.from_dict(_raw(mlp_layer_types=["dense", "sparse"]))
