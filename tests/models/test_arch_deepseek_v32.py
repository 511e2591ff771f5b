"""DeepSeek-V3.2 (deepseek_v32) against transformers: DSA with top-k below the prompt lengths, an indexer on every
layer (half-split RoPE), YaRN, q LoRA, the first layer dense."""
from tests.models.arch_harness import YARN, ArchCase
from tests.models.dsa_suite import DSASuite


class TestDeepseekV32(DSASuite):
    case = ArchCase("deepseek_v32", dict(
        q_lora_rank=32, first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, rope_parameters=YARN, index_topk=8, index_n_heads=16, index_head_dim=32),
        native_attention=False)
