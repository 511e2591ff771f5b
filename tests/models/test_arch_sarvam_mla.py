"""Sarvam (sarvam_mla) against transformers: V3 without q LoRA, routing over one group, first layer dense."""
from tests.models.arch_harness import YARN, ArchCase, ArchSuite


class TestSarvamMLA(ArchSuite):
    case = ArchCase("sarvam_mla", dict(q_lora_rank=None, n_group=1, topk_group=1, first_k_dense_replace=1,
                                       routed_scaling_factor=2.5, norm_topk_prob=True, rope_parameters=YARN))
