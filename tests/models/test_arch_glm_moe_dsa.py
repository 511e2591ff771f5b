"""GLM-5 (glm_moe_dsa) against transformers: DSA with top-k below the prompt lengths, interleaved indexer RoPE, the
second layer sharing the first's top-k, the last running its own; plain RoPE at GLM's theta."""
import pytest

from latentserve.models import ModelConfig
from tests.models.arch_harness import ArchCase
from tests.models.dsa_suite import DSASuite


class TestGlmMoeDsa(DSASuite):
    case = ArchCase("glm_moe_dsa", dict(
        q_lora_rank=32, v_head_dim=32, first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.8,
        norm_topk_prob=True, rope_parameters=dict(rope_type="default", rope_theta=1e6), index_topk=8,
        index_n_heads=16, index_head_dim=32, indexer_types=["full", "shared", "full"]), native_attention=False)


def _raw(**overrides) -> dict:
    raw = TestGlmMoeDsa.case.transformers_config().to_dict() | {"architectures": ["GlmMoeDsaForCausalLM"]}
    return {k: v for k, v in (raw | overrides).items() if v is not None}


def test_indexer_layers_follow_indexer_types_or_the_schedule() -> None:
    assert ModelConfig.from_dict(_raw()).dsa.indexer_layers == (True, False, True)
    # transformers' schedule without the list: every index_topk_freq-th layer from the offset runs an indexer
    raw = _raw(indexer_types=None, num_hidden_layers=6, mlp_layer_types=None, index_topk_freq=2,
               index_skip_topk_offset=2)
    assert ModelConfig.from_dict(raw).dsa.indexer_layers == (True, True, False, True, False, True)
    assert ModelConfig.from_dict(_raw(indexer_types=None, index_topk_pattern="FSS")).dsa.indexer_layers == (
        True, False, False)
    with pytest.raises(ValueError, match="indexer_types"):
        ModelConfig.from_dict(_raw(indexer_types=["full", "dense", "full"]))
    with pytest.raises(ValueError, match="must start with 'full'"):
        ModelConfig.from_dict(_raw(indexer_types=["shared", "full", "full"]))
    with pytest.raises(ValueError, match="q_lora_rank"):
        ModelConfig.from_dict(_raw(q_lora_rank=None))
