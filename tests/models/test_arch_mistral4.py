"""Mistral 4 (mistral4) against transformers: softmax routing over groups scored by their best two experts, every
layer an MoE, Llama 4 query scaling on YaRN (a small original context, so that prompts cross several multiples of
it), q LoRA, the routed experts saved as 3-D tensors."""
import pytest
import torch

from latentserve.layers.moe import RoutingConfig, select_experts
from tests.models.arch_harness import ArchCase, ArchSuite

YARN = dict(type="yarn", rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8,
            max_position_embeddings=256, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
            llama_4_scaling_beta=0.1, partial_rotary_factor=0.5)


class TestMistral4(ArchSuite):
    case = ArchCase("mistral4", dict(q_lora_rank=32, n_group=4, topk_group=2, first_k_dense_replace=0,
                                     norm_topk_prob=True, routed_scaling_factor=1.0, rope_parameters=YARN),
                    # no query scaling in the one-call attention block, no top-2 group scoring in the routing kernel
                    native_attention=False, native_moe=False, model_class="Mistral4ForCausalLM")


class TestMistral4OneGroup(ArchSuite):
    """As published: one routing group (the native routing runs it)."""
    case = ArchCase("mistral4", dict(q_lora_rank=32, n_group=1, topk_group=1, first_k_dense_replace=1,
                                     rope_parameters=YARN), native_attention=False,
                    model_class="Mistral4ForCausalLM")


def test_group_limited_top2_matches_transformers() -> None:
    from transformers.models.mistral4.modeling_mistral4 import Mistral4TopkRouter

    hf_config = TestMistral4.case.transformers_config()
    router = Mistral4TopkRouter(hf_config)
    torch.nn.init.normal_(router.weight, std=1.0, generator=torch.Generator().manual_seed(0))
    x = torch.randn(64, hf_config.hidden_size, generator=torch.Generator().manual_seed(1))
    _, weights, ids = router(x)
    cfg = RoutingConfig(8, 2, "softmax", "group_limited_top2", n_group=4, topk_group=2, norm_topk_prob=True)
    assert not cfg.native_routing
    ours, our_ids = select_experts(x @ router.weight.detach().t(), cfg)
    order, our_order = ids.sort(-1), our_ids.sort(-1)
    assert torch.equal(order.values, our_order.values)
    torch.testing.assert_close(ours.gather(1, our_order.indices), weights.detach().gather(1, order.indices))
    with pytest.raises(ValueError, match="top 2"):
        RoutingConfig(8, 2, "softmax", "group_limited_top2", n_group=8, topk_group=2)


def test_config_reads_rope_share_and_query_scaling() -> None:
    from latentserve.models import ModelConfig

    raw = TestMistral4.case.transformers_config().to_dict() | {"architectures": ["Mistral4ForCausalLM"]}
    config = ModelConfig.from_dict(raw)
    assert config.llama4_scaling_beta == 0.1 and config.rope.rope_type == "yarn"
    assert config.routing.topk_method == "group_limited_top2" and config.routing.scoring_func == "softmax"
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ModelConfig.from_dict(raw | {"rope_parameters": {**YARN, "partial_rotary_factor": 0.25}})


def test_expert_parallel_rank_reads_only_its_experts_from_the_3d_tensors(tmp_path) -> None:
    """Under expert parallelism `prepare` drops the other ranks' experts: their slices of the stored 3-D tensors
    are not loaded, this rank's are, exactly."""
    from torch import nn

    from latentserve.layers.moe import MoE
    from latentserve.models import load_model
    from tests.models.arch_harness import make_arch_checkpoint

    path = make_arch_checkpoint(tmp_path, TestMistral4.case)

    def keep_first_half(model) -> None:
        for moe in (m for m in model.modules() if isinstance(m, MoE)):
            for i in range(4, 8):
                moe.experts[i] = nn.Identity()

    full, half = load_model(path), load_model(path, prepare=keep_first_half)
    for a, b in zip(full.model.layers, half.model.layers):
        for i in range(4):
            assert torch.equal(a.mlp.experts[i].down_proj.weight, b.mlp.experts[i].down_proj.weight)
        assert isinstance(b.mlp.experts[5], nn.Identity)
