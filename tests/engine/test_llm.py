"""The whole engine against transformers, and against itself under DBO, caching, chunking, preemption."""
from __future__ import annotations

import pytest
import torch

from latentserve import LLM, SamplingParams
from tests.checkpoints import VARIANTS, load_reference, make_checkpoint

PROMPTS = [[5, 17, 33, 2, 9, 41, 77, 12, 60], [3, 88], list(range(10, 40)), [70, 71, 72, 73, 74]]
# Short outputs keep the many-engine tests fast; the transformers comparison runs 32 tokens.
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {variant: make_checkpoint(root, variant) for variant in VARIANTS}


def _llm(path, **kwargs):
    # fp32: these compare with transformers' fp32 and across engines at fp32 round-off (dtype="auto" may be bf16).
    defaults = dict(dtype="float32", block_size=4, num_kv_blocks=128, max_num_batched_tokens=256)
    return LLM(model=str(path), **{**defaults, **kwargs})


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_matches_transformers(checkpoints, variant):
    path = checkpoints[variant]
    ref = load_reference(path)
    ref.generation_config.eos_token_id = None  # like ignore_eos: no early stop, nothing suppressed
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, prompt_logprobs=0)
    outputs = _llm(path).generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs):
        with torch.no_grad():
            ref_logprobs = ref(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
        assert out.prompt_logprobs[0] is None
        for pos in range(1, len(prompt)):
            ours = out.prompt_logprobs[pos][prompt[pos]].logprob
            assert abs(ours - ref_logprobs[pos - 1, prompt[pos]].item()) <= 1e-4, (variant, pos)
        expected = ref.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)
        assert out.outputs[0].token_ids == expected[0, len(prompt):].tolist(), variant


@pytest.mark.parametrize("variant", ["v2_lite", "v3"])
def test_same_outputs_under_every_engine_mode(checkpoints, variant):
    path = checkpoints[variant]
    shared = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]  # prefixes shared across prompts (several blocks)
    prompts = PROMPTS + [shared + [20, 21], shared + [30], shared + [20, 21, 22, 23, 24]]
    baseline = _tokens(_llm(path, enable_prefix_caching=False).generate(prompts, GREEDY))
    modes = {
        "dbo": dict(enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=2),
        "prefix_caching": dict(enable_prefix_caching=True),
        "chunked_prefill": dict(max_num_batched_tokens=8),
        # 16 blocks of 4 tokens: one request of max_model_len fits, all prompts at once do not.
        "preemption": dict(num_kv_blocks=16, max_model_len=64, max_num_batched_tokens=64),
        "dbo_chunked_preempt": dict(
            enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=2, max_num_batched_tokens=16,
            num_kv_blocks=16, max_model_len=64,
        ),
        "one_by_one": None,
    }
    for name, kwargs in modes.items():
        if kwargs is None:
            llm = _llm(path)
            got = [_tokens(llm.generate([p], GREEDY))[0] for p in prompts]
        else:
            llm = _llm(path, **kwargs)
            got = _tokens(llm.generate(prompts, GREEDY))
        assert got == baseline, name


def test_preemption_really_happens(checkpoints):
    llm = _llm(checkpoints["v3"], num_kv_blocks=16, max_model_len=64, max_num_batched_tokens=64)
    preempted = []
    original = llm.engine.scheduler._preempt

    def spy(request):
        preempted.append(request.request_id)
        original(request)

    llm.engine.scheduler._preempt = spy
    llm.generate(PROMPTS, GREEDY)
    assert preempted


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float16"])
def test_half_precision_kv_cache_stays_close(checkpoints, kv_cache_dtype):
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=0)
    full = _llm(checkpoints["v3"]).generate(PROMPTS, params)
    half = _llm(checkpoints["v3"], kv_cache_dtype=kv_cache_dtype).generate(PROMPTS, params)
    for a, b in zip(full, half):
        for pos in range(1, len(a.prompt_token_ids)):
            token = a.prompt_token_ids[pos]
            assert abs(a.prompt_logprobs[pos][token].logprob - b.prompt_logprobs[pos][token].logprob) <= 5e-2


def test_prefix_cache_hits_are_reported(checkpoints):
    llm = _llm(checkpoints["v3"])
    shared = list(range(40, 60))
    llm.generate([shared + [1]], GREEDY)
    out = llm.generate([shared + [2]], GREEDY)[0]
    assert out.num_cached_tokens >= 16


def test_dbo_splits_steps(checkpoints):
    llm = _llm(checkpoints["v3"], enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=2)
    seen = []
    execute = llm.engine.runner.execute_model

    def spy(out):
        result = execute(out)
        seen.append((out.num_scheduled_tokens, result.num_ubatches))
        return result

    llm.engine.runner.execute_model = spy
    llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4))
    assert all(n == 2 for tokens, n in seen if tokens >= 2)


def test_logprobs_shape(checkpoints):
    out = _llm(checkpoints["v3"]).generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=3, logprobs=2))[0]
    completion = out.outputs[0]
    assert len(completion.logprobs) == 3
    for token, entry in zip(completion.token_ids, completion.logprobs):
        assert token in entry and 2 <= len(entry) <= 3
        assert sorted(lp.rank for lp in entry.values()) == [1, 2] and entry[token].rank == 1
        assert all(lp.decoded_token is None for lp in entry.values())  # the checkpoint has no tokenizer
        # greedy: the chosen token is the most likely
        assert max(lp.logprob for lp in entry.values()) == entry[token].logprob


def test_seeded_sampling_is_reproducible(checkpoints):
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=1234, max_tokens=10)
    a = _tokens(_llm(checkpoints["v3"]).generate([PROMPTS[0]], params))
    b = _tokens(_llm(checkpoints["v3"]).generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], params))
    assert a[0] == b[0]


def test_bad_inputs_are_clear_errors_and_other_requests_complete(checkpoints, tmp_path):
    path = checkpoints["v3"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(model=str(tmp_path / "missing"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        LLM(model=str(bad))
    llm = _llm(path, max_model_len=64)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="max_model_len=64"):
        llm.generate([list(range(1, 70))], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 10_000]], GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=-1))
    with pytest.raises(TypeError, match="unknown argument"):
        LLM(model=str(path), not_an_option=1)

    # A bad request added to a running engine is refused alone; the others finish.
    engine = llm.engine
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=5)) for p in PROMPTS[:2]]
    engine.step()
    with pytest.raises(ValueError):
        engine.add_request(list(range(1, 70)), GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert sorted(done) == sorted(ids) and all(len(o.outputs[0].token_ids) == 5 for o in done.values())


def test_a_failed_step_leaves_nothing_behind(checkpoints, monkeypatch):
    """A step that raises fails that generate call only; the next call runs as on a fresh engine."""
    expected = _tokens(_llm(checkpoints["v3"], max_num_batched_tokens=8).generate(PROMPTS, GREEDY))
    llm = _llm(checkpoints["v3"], max_num_batched_tokens=8)  # chunked: the failure lands mid-prefill
    execute = llm.engine.runner.execute_model
    calls = []

    def fail_third_step(out):
        calls.append(out)
        if len(calls) == 3:
            raise RuntimeError("injected step failure")
        return execute(out)

    monkeypatch.setattr(llm.engine.runner, "execute_model", fail_third_step)
    with pytest.raises(RuntimeError, match="injected step failure"):
        llm.generate(PROMPTS, GREEDY)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.block_manager.usage == 0
    assert _tokens(llm.generate(PROMPTS, GREEDY)) == expected


def test_requests_in_one_step_share_the_blocks_it_writes(checkpoints):
    """Prompts with a common prefix admitted together share its blocks, and outputs do not change."""
    shared = list(range(40, 52))  # three blocks of 4
    prompts = [shared + [1, 2], shared + [3, 4], shared[:8] + [5]]
    expected = _tokens(_llm(checkpoints["v3"], enable_prefix_caching=False).generate(prompts, GREEDY))
    dbo = dict(enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=2)
    for kwargs in ({}, dbo):
        llm = _llm(checkpoints["v3"], **kwargs)
        steps = []
        schedule = llm.engine.scheduler.schedule
        llm.engine.scheduler.schedule = lambda: steps.append(schedule()) or steps[-1]
        outputs = llm.generate(prompts, GREEDY)
        assert _tokens(outputs) == expected
        assert len(steps[0].scheduled) == 3  # all three prompts in the first step
        # The second starts from the first's three blocks; the third would be left with one new token, a
        # decode that could run ahead of the blocks' writer, so it takes none of them.
        assert [o.num_cached_tokens for o in outputs] == [0, 12, 0]


def test_a_failed_step_takes_its_blocks_out_of_the_cache(checkpoints, monkeypatch):
    shared = list(range(40, 52))
    prompts = [shared + [1, 2], shared + [3, 4]]
    expected = _tokens(_llm(checkpoints["v3"], enable_prefix_caching=False).generate(prompts, GREEDY))
    llm = _llm(checkpoints["v3"])
    execute = llm.engine.runner.execute_model

    def fail_first_step(out):
        monkeypatch.setattr(llm.engine.runner, "execute_model", execute)
        raise RuntimeError("injected step failure")

    monkeypatch.setattr(llm.engine.runner, "execute_model", fail_first_step)
    with pytest.raises(RuntimeError, match="injected step failure"):
        llm.generate(prompts, GREEDY)
    outputs = llm.generate(prompts, GREEDY)  # would read never-written blocks if they were still cached
    assert _tokens(outputs) == expected and outputs[0].num_cached_tokens == 0
