"""A.X K2 (axk2) against transformers: DSA with top-k below the prompt lengths (half-split indexer RoPE), the fused
query and output-gate projection, gated RMSNorms (every input norm, the MoE layers' post-attention norm), routing
without groups as A.X K2 Light, YaRN, the first layer dense."""
import pytest

from latentserve.models import ModelConfig, load_model
from latentserve.layers.gated_norm import GatedRMSNorm
from latentserve.layers.norm import RMSNorm
from tests.models.arch_harness import YARN, ArchCase
from tests.models.dsa_suite import DSASuite


class TestAXK2(DSASuite):
    case = ArchCase("axk2", dict(
        q_lora_rank=32, mlp_layer_types=["dense", "sparse", "sparse"], routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_parameters=YARN, index_topk=8, index_n_heads=16, index_head_dim=32, gated_norm_rank=16),
        native_attention=False)

    def test_gated_norms_where_the_model_has_them(self, checkpoint) -> None:
        layers = load_model(checkpoint).model.layers
        assert all(isinstance(layer.input_layernorm, GatedRMSNorm) for layer in layers)
        assert [type(layer.post_attention_layernorm) for layer in layers] == [RMSNorm, GatedRMSNorm, GatedRMSNorm]


class TestAXK2Grouped(DSASuite):
    """The larger releases route DeepSeek-V3's way, over expert groups."""
    case = ArchCase("axk2", dict(
        q_lora_rank=32, mlp_layer_types=["sparse", "dense", "sparse"], n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True, rope_parameters=YARN, index_topk=8, index_n_heads=16,
        index_head_dim=32, gated_norm_rank=16), native_attention=False)


def _raw(**overrides) -> dict:
    raw = TestAXK2.case.transformers_config().to_dict() | {"architectures": ["AXK2ForCausalLM"]}
    return {k: v for k, v in (raw | overrides).items() if v is not None}


def test_config_errors_name_the_field() -> None:
    config = ModelConfig.from_dict(_raw())
    assert config.routing.n_group == 1 and config.q_output_gate and config.gated_norm_rank == 16
    with pytest.raises(ValueError, match="n_group"):
        ModelConfig.from_dict(_raw(topk_group=2))
    with pytest.raises(ValueError, match="q_lora_rank"):
        ModelConfig.from_dict(_raw(q_lora_rank=None))
    with pytest.raises(ValueError, match="gated_norm_rank"):
        ModelConfig.from_dict(_raw(gated_norm_rank=0))
