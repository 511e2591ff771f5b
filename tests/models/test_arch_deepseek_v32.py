"""DeepSeek-V3.2 (deepseek_v32) against transformers: DSA with top-k below the prompt lengths, an indexer on every
layer (half-split RoPE), YaRN, q LoRA, the first layer dense."""
from latentserve import SamplingParams
from tests.models.arch_harness import PROMPTS, YARN, ArchCase, llm, make_arch_checkpoint
from tests.models.dsa_suite import DSASuite
from tests.models.mtp_checkpoint import with_mtp_layer


class TestDeepseekV32(DSASuite):
    case = ArchCase("deepseek_v32", dict(
        q_lora_rank=32, first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, rope_parameters=YARN, index_topk=8, index_n_heads=16, index_head_dim=32),
        native_attention=False)


def test_mtp_speculative_decoding_keeps_greedy_output(tmp_path) -> None:
    """The MTP layer runs its own indexer over its own caches; verification steps are decodes of k+1 tokens on the
    sparse path. Greedy output is the model's, drafts or not."""
    base = make_arch_checkpoint(tmp_path, TestDeepseekV32.case)
    path = with_mtp_layer(base, tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)  # (logprobs would stop drafting)
    plain = llm(path).generate(PROMPTS, params)
    spec = {"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": None}
    engine = llm(path, speculative_config=spec)
    drafted = engine.generate(PROMPTS, params)
    assert engine.engine.spec_decoding_stats.num_draft_tokens > 0
    for a, b in zip(plain, drafted):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
