"""Ling / Ring hybrids (bailing_hybrid) against transformers: gated-decay KDA layers over per-request states, MLA with a
head-wise output gate every layer_group_size-th layer, V3 MoE."""
import pytest
import torch

from latentserve.models import ModelConfig
from tests.checkpoints import load_reference
from tests.models.arch_harness import GREEDY, MAX_TOKENS, PROMPTS, ArchCase, ArchSuite, llm, prompt_logprobs


class TestBailingHybrid(ArchSuite):
    # transformers reads the KDA head width back from head_dim, which it saves as the rope width: keep them equal.
    case = ArchCase("bailing_hybrid", dict(num_hidden_layers=4, q_lora_rank=None, head_dim=16, layer_group_size=4,
                                           first_k_dense_replace=1, num_local_experts=8, n_group=1, topk_group=1),
                    # int4: three recurrent layers carry each token's rounding into every later one (0.50 measured)
                    drop=("n_routed_experts",), native_attention=False, int4_error=0.6)

    def test_batch_invariant_mode(self, checkpoint) -> None:
        """Not yet checked to the bit: batch-invariant mode refuses the linear-attention layers, naming them."""
        with pytest.raises(ValueError, match="linear-attention layers"):
            llm(checkpoint, batch_invariant=True)

    def test_layer_pattern(self, checkpoint) -> None:
        model = llm(checkpoint).engine.runner.model
        assert model.config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
        assert model.config.linear_attention.gate_lower_bound == -5.0 and model.config.head_output_gate

    def test_decode_matches_transformers_generate(self, checkpoint, greedy) -> None:
        reference = load_reference(checkpoint)
        reference.generation_config.eos_token_id = None  # ours ran past EOS (ignore_eos)
        for prompt, out in zip(PROMPTS, greedy):
            expected = reference.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
            assert out.outputs[0].token_ids == expected[0, len(prompt):].tolist()

    def test_speculative_decoding_is_refused(self, checkpoint) -> None:
        """Its config declares an MTP layer, but a rejected draft would stay folded into the linear-attention state."""
        with pytest.raises(ValueError, match="cannot roll back rejected drafts"):
            llm(checkpoint, speculative_config={"method": "mtp", "num_speculative_tokens": 1})

    def test_chunked_prefill_and_preemption_equal_one_batch(self, checkpoint, greedy) -> None:
        engine = llm(checkpoint, max_num_batched_tokens=8, num_kv_blocks=14, max_model_len=48)
        for a, b in zip(greedy, engine.generate(PROMPTS, GREEDY)):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            torch.testing.assert_close(torch.tensor(prompt_logprobs(b)), torch.tensor(prompt_logprobs(a)),
                                       rtol=0, atol=1e-5)


def test_swiglu_clipping_is_refused() -> None:
    raw = TestBailingHybrid.case.transformers_config().to_dict() | {"architectures": ["BailingHybridForCausalLM"]}
    with pytest.raises(ValueError, match="'expert_swiglu_limit_list' clips the SwiGLU"):
        ModelConfig.from_dict(raw | {"expert_swiglu_limit_list": [0, 7.0, 0, 0]})
