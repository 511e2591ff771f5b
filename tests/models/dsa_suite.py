"""The architecture suite for DSA models (deepseek_v32, glm_moe_dsa), plus what sparsity adds: the selection must
survive chunked prefill and prefix caching (keys read back from the indexer cache), and bf16 stays close."""
from __future__ import annotations

import pytest
import torch

from latentserve import SamplingParams
from tests.models.arch_harness import GREEDY, PROMPTS, ArchSuite, llm, prompt_logprobs


class DSASuite(ArchSuite):
    def test_batch_invariant_mode(self, checkpoint) -> None:
        """The indexer and sparse attention batch tokens together: batch-invariant mode refuses DSA, naming it."""
        with pytest.raises(ValueError, match="DeepSeek Sparse Attention"):
            llm(checkpoint, batch_invariant=True)

    def test_topk_is_below_the_prompts(self) -> None:
        assert self.case.config["index_topk"] < max(len(p) for p in PROMPTS)

    def test_chunked_prefill_matches(self, checkpoint, greedy) -> None:
        """Prompts prefilled 5 tokens a step: each chunk's tokens select over context keys from the cache."""
        chunked = llm(checkpoint, enable_chunked_prefill=True, max_num_batched_tokens=5, max_num_seqs=2)
        for a, b in zip(greedy, chunked.generate(PROMPTS, GREEDY)):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            torch.testing.assert_close(torch.tensor(prompt_logprobs(b)), torch.tensor(prompt_logprobs(a)),
                                       rtol=0, atol=1e-5)

    def test_prefix_cache_hit_matches(self, checkpoint, greedy) -> None:
        """A second request sharing a long prefix starts from cached blocks: both caches' rows are reused."""
        engine = llm(checkpoint, enable_prefix_caching=True)
        long_prompt = PROMPTS[2]
        params = SamplingParams(temperature=0.0, max_tokens=GREEDY.max_tokens, ignore_eos=True, logprobs=0)
        first = engine.generate([long_prompt], params)[0]  # (prompt log-probs would turn the prefix cache off)
        second = engine.generate([long_prompt], params)[0]
        assert second.num_cached_tokens > 0
        reference = greedy[2]
        for out in (first, second):
            assert out.outputs[0].token_ids == reference.outputs[0].token_ids
            torch.testing.assert_close(torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs,
                                                                            out.outputs[0].token_ids)]),
                                       torch.tensor([lp[t].logprob for lp, t in zip(reference.outputs[0].logprobs,
                                                                            reference.outputs[0].token_ids)]),
                                       rtol=0, atol=1e-5)

    def test_bf16_stays_close(self, checkpoint, greedy) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0)
        outputs = llm(checkpoint, dtype="bfloat16").generate(PROMPTS, params)
        full = torch.tensor([lp for out in greedy for lp in prompt_logprobs(out)])
        half = torch.tensor([lp for out in outputs for lp in prompt_logprobs(out)])
        assert (half - full).abs().mean().item() < 0.1

    def test_kv_memory_budget_holds_the_indexer_caches(self, checkpoint) -> None:
        """kv_cache_memory_bytes bounds the latent and the indexer caches together."""
        budget = 200_000
        engine = llm(checkpoint, num_kv_blocks=None, kv_cache_memory_bytes=budget, max_model_len=64)
        caches = engine.engine.runner.kv_caches
        assert any(name.endswith(".indexer") for name in caches)
        used = sum(t.numel() * t.element_size() for t in caches.values())
        per_block = used // next(iter(caches.values())).shape[0]
        assert budget - per_block < used <= budget
