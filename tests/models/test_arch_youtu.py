"""Youtu-LLM (youtu) against transformers: dense MLPs in every layer, tied embeddings, q LoRA, YaRN."""
from latentserve.models import ModelConfig
from tests.models.arch_harness import YARN, ArchCase, ArchSuite


class TestYoutu(ArchSuite):
    case = ArchCase("youtu", dict(q_lora_rank=32, tie_word_embeddings=True, rope_parameters=YARN),
                    drop=("n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size"),
                    native_moe=False)


def test_dense_everywhere_and_tied_by_default() -> None:
    raw = TestYoutu.case.transformers_config().to_dict() | {"architectures": ["YoutuForCausalLM"]}
    del raw["tie_word_embeddings"]
    config = ModelConfig.from_dict(raw | {"n_routed_experts": 8, "num_experts_per_tok": 2})
    assert config.routing is None and config.tie_word_embeddings
    assert not any(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
