"""Engine-level checks of the attention core's bounds: context read through a small workspace, and KV a decode
must not read before it is written."""
from __future__ import annotations

import math

import pytest

from latentserve import LLM, SamplingParams
from tests.checkpoints import make_checkpoint

PROMPTS = [[5, 17, 33, 2, 9, 41, 77, 12, 60], [3, 88], list(range(10, 40)), [70, 71, 72, 73, 74]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
DBO = dict(enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "v3")


def _llm(path, **kwargs) -> LLM:
    defaults = dict(dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=256, num_threads=1)
    return LLM(model=str(path), **{**defaults, **kwargs})


def _assert_same(outputs, expected) -> None:
    for out, ref in zip(outputs, expected, strict=True):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        for ours, theirs, token in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs, ref.outputs[0].token_ids):
            assert math.isfinite(ours[token].logprob) and abs(ours[token].logprob - theirs[token].logprob) <= 1e-4


def test_context_read_through_a_small_workspace(checkpoint):
    """Chunked prefill leaves long contexts; a 4-token workspace makes the engine gather and merge them in pieces."""
    expected = _llm(checkpoint, enable_prefix_caching=False).generate(PROMPTS, GREEDY)
    llm = _llm(checkpoint, enable_prefix_caching=False, max_num_batched_tokens=8, max_num_seqs=4, workspace_tokens=4)
    chunks = []
    for builder in llm.engine.runner.builders:
        plan = builder._plan_context_chunks
        builder._plan_context_chunks = lambda *a, plan=plan: chunks.append(plan(*a)) or chunks[-1]
    _assert_same(llm.generate(PROMPTS, GREEDY), expected)
    assert max(len(c.slots) for c in chunks) >= 5
    assert all(s.numel() <= 4 for c in chunks for s in c.slots)


def test_decode_never_reads_kv_its_step_writes_later(checkpoint):
    """A cache full of NaN: any read of a slot before its write shows in the output.

    The third prompt matches two blocks the first writes in the same step; taking them would leave it one new
    token, a decode, which runs first in ubatch 0 while the first prompt's split puts part of those blocks in
    ubatch 1.
    """
    shared = list(range(40, 52))  # three blocks of 4
    prompts = [shared + [1, 2], shared + [3, 4], shared[:8] + [5]]
    expected = _llm(checkpoint, enable_prefix_caching=False).generate(prompts, GREEDY)
    llm = _llm(checkpoint, enable_prefix_caching=True, **DBO)
    for cache in llm.engine.runner.kv_caches.values():
        cache.fill_(float("nan"))
    steps = []
    execute = llm.engine.runner.execute_model
    llm.engine.runner.execute_model = lambda out: steps.append((len(out.scheduled), execute(out))) or steps[-1][1]
    _assert_same(llm.generate(prompts, GREEDY), expected)
    assert steps[0][0] == 3 and steps[0][1].num_ubatches == 2  # all three in one split step
