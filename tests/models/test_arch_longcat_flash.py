"""LongCat-Flash (longcat_flash) against transformers: two attention + MLP sublayers per layer with a shortcut MoE
(its own KV cache per attention sublayer), softmax routing steered by the correction bias over real and
zero-compute experts, the q and kv LoRA scaling. The attention sublayers take the one-call decode block; the
shortcut MoE runs its modules."""
from tests.models.arch_harness import ArchCase, ArchSuite

# BASE fields LongCat-Flash names otherwise (or derives: num_hidden_layers is twice num_layers)
_RENAMED = ("num_experts_per_tok", "n_shared_experts", "moe_intermediate_size", "intermediate_size",
            "num_hidden_layers")


class TestLongcatFlash(ArchSuite):
    case = ArchCase("longcat_flash", dict(
        num_layers=2, ffn_hidden_size=64, expert_ffn_hidden_size=32, n_routed_experts=8, zero_expert_num=4,
        moe_topk=3, routed_scaling_factor=2.0, q_lora_rank=32, head_dim=16,
        rope_parameters=dict(rope_type="default", rope_theta=10000000.0)), drop=_RENAMED, native_moe=False)

    def test_two_kv_caches_per_layer(self, checkpoint) -> None:
        from tests.models.arch_harness import llm

        model = llm(checkpoint).engine.runner.model
        assert model.attention_layer_names == [f"model.layers.{i}.self_attn.{j}.attn" for i in (0, 1) for j in (0, 1)]
        assert model.config.num_attention_layers == 4 and len(model.model.layers[0].mlp.experts) == 8
