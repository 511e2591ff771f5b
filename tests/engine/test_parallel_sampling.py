"""n and best_of: samples share the prompt's KV blocks and equal independent requests with the derived seeds."""
from __future__ import annotations

import pytest

from latentserve import LLM, SamplingParams
from tests.checkpoints import make_checkpoint

PROMPT = list(range(10, 24))  # 14 tokens: three full blocks of 4, then two tokens
SAMPLE = dict(temperature=1.0, max_tokens=8, ignore_eos=True)
DBO = dict(enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=2)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "v3")


def _llm(path, **kwargs):
    defaults = dict(dtype="float32", block_size=4, num_kv_blocks=128, max_num_batched_tokens=256)  # bf16 round-off
    return LLM(model=str(path), **{**defaults, **kwargs})


def _independent(path, params_list, prompt=PROMPT):
    """Each sample as its own request, on an engine that shares nothing between them."""
    outputs = _llm(path, enable_prefix_caching=False).generate([prompt] * len(params_list), params_list)
    return [o.outputs[0] for o in outputs]


@pytest.mark.parametrize("mode", ["no_prefix_caching", "prefix_caching", "dbo", "chunked_preempt"])
def test_n_samples_equal_independent_requests_with_derived_seeds(path, mode):
    kwargs = {
        "no_prefix_caching": dict(enable_prefix_caching=False),
        "prefix_caching": {},
        "dbo": DBO,
        # 8 blocks: the samples cannot all hold their blocks, so some are preempted and recomputed.
        "chunked_preempt": dict(num_kv_blocks=8, max_model_len=32, max_num_batched_tokens=8, **DBO),
    }[mode]
    expected = _independent(path, [SamplingParams(seed=7 + i, **SAMPLE) for i in range(3)])
    llm = _llm(path, **kwargs)
    preempt = llm.engine.scheduler._preempt
    preempted = []
    llm.engine.scheduler._preempt = lambda r: preempted.append(r.request_id) or preempt(r)
    out = llm.generate([PROMPT, [3, 88]], SamplingParams(n=3, seed=7, **SAMPLE))[0]
    assert bool(preempted) == (mode == "chunked_preempt")
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in expected]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3  # distinct streams
    assert all(c.finish_reason == "length" for c in out.outputs) and out.finished
    assert not llm.engine.has_unfinished_requests() and llm.engine.scheduler.block_manager.usage == 0


def test_samples_fork_the_prompt_blocks_instead_of_recomputing_them(path):
    llm = _llm(path, enable_prefix_caching=False)  # sharing must not depend on the prefix cache
    engine = llm.engine
    bm = engine.scheduler.block_manager
    scheduled, leader_refs = [], []
    execute = engine.runner.execute_model

    def spy(out):
        scheduled.append(out.num_scheduled_tokens)
        group = engine.scheduler.groups.get("g")
        if group is not None and group.forked:
            leader_refs.append([bm.blocks[b].ref_cnt for b in group.leader.block_ids[:3]])
        return execute(out)

    engine.runner.execute_model = spy
    engine.add_request(PROMPT, SamplingParams(n=3, seed=1, **SAMPLE), "g")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    # The leader computes all 14 prompt tokens; each other sample only the 2 past the 3 shared blocks.
    assert sum(scheduled) == 14 + 2 * 2 + 3 * (SAMPLE["max_tokens"] - 1)
    assert bm.num_forked_blocks == 2 * 3
    assert leader_refs and leader_refs[0] == [3, 3, 3]
    final = outputs[-1]
    assert final.request_id == "g" and final.finished and len(final.outputs) == 3
    assert bm.usage == 0 and not engine.scheduler.groups


def test_best_of_returns_the_n_most_likely_samples(path):
    candidates = _independent(path, [SamplingParams(seed=3 + i, logprobs=0, **SAMPLE) for i in range(4)])
    ranked = sorted(candidates, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    out = _llm(path).generate([PROMPT], SamplingParams(n=2, best_of=4, seed=3, **SAMPLE))[0]
    assert [c.index for c in out.outputs] == [0, 1]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ranked]
    for got, want in zip(out.outputs, ranked):
        assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-3)
        assert got.logprobs is None  # tracked for the ranking, not asked for


def test_best_of_reports_only_at_the_end(path):
    engine = _llm(path).engine
    engine.add_request(PROMPT, SamplingParams(n=1, best_of=2, **SAMPLE), "b")
    engine.add_request(PROMPT, SamplingParams(n=2, **SAMPLE), "n")
    seen = []
    while engine.has_unfinished_requests():
        seen += [(o.request_id, o.finished, len(o.outputs)) for o in engine.step()]
    assert [s for s in seen if s[0] == "b"] == [("b", True, 1)]
    streamed = [s for s in seen if s[0] == "n"]
    assert len(streamed) >= SAMPLE["max_tokens"] and all(n == 2 for _, _, n in streamed)
    assert [f for _, f, _ in streamed].count(True) == 1 and streamed[-1][1]


def test_prompt_logprobs_and_greedy_samples(path):
    single = _llm(path).generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1))[0]
    out = _llm(path).generate([PROMPT], SamplingParams(n=2, temperature=0, max_tokens=4, prompt_logprobs=1))[0]
    assert out.prompt_logprobs == single.prompt_logprobs
    assert [c.token_ids for c in out.outputs] == [single.outputs[0].token_ids] * 2


def test_aborting_a_request_aborts_every_sample(path):
    engine = _llm(path).engine
    engine.add_request(PROMPT, SamplingParams(n=3, **SAMPLE), "a")
    engine.step()  # the leader's prefill; the others have forked and wait
    engine.step()
    engine.abort_request("a")
    assert not engine.has_unfinished_requests() and not engine.scheduler.groups
    assert engine.scheduler.block_manager.usage == 0
    engine.add_request(PROMPT, SamplingParams(n=2), "x")
    for taken in ("x", "1_x"):
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request(PROMPT, SamplingParams(), taken)
