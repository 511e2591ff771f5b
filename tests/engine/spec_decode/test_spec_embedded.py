"""Speculative decoding on the embedded model and its trained MTP layer: same greedy text, stop strings that end a
request inside a verified draft."""
from __future__ import annotations

import pytest

from latentserve import LLM, SamplingParams

PROMPTS = ["And God said", "In the beginning", "The LORD is my shepherd", "And it came to pass"]
ENGINE = dict(dtype="float32", num_threads=1, num_kv_blocks=64)  # bf16 round-off would flip near-ties
SPEC = {"method": "mtp", "num_speculative_tokens": 3, "disable_by_batch_size": None}  # drafting at every batch


@pytest.fixture(scope="module")
def engines():
    return LLM(**ENGINE), LLM(speculative_config=SPEC, **ENGINE)


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_text_equals_the_text_without_speculation(engines, batch: int) -> None:
    plain, spec = engines
    params = SamplingParams(temperature=0.0, max_tokens=23)  # 23: the last verification is cut short
    expected = [o.outputs[0].token_ids for o in plain.generate(PROMPTS[:batch], params)]
    before = spec.engine.spec_decoding_stats.num_accepted_tokens
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS[:batch], params)] == expected
    assert spec.engine.spec_decoding_stats.num_accepted_tokens > before  # the trained MTP layer's drafts land


def test_a_stop_string_inside_a_draft_ends_the_request_there(engines) -> None:
    plain, spec = engines
    text = plain.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=30))[0].outputs[0].text
    last_step_sizes = []
    for i, stop in enumerate(dict.fromkeys(text.split()[3:12])):  # words well into the continuation
        params = SamplingParams(temperature=0.0, max_tokens=30, stop=[stop])
        expected = plain.generate(PROMPTS[0], params)[0].outputs[0]
        done, sizes = _run(spec, PROMPTS[0], params, f"stop{i}")
        assert done.outputs[0].text == expected.text and done.outputs[0].token_ids == expected.token_ids
        assert done.outputs[0].finish_reason == "stop" and stop not in done.outputs[0].text
        last_step_sizes.append(sizes[-1])
    assert max(last_step_sizes) > 1  # some stop came out of a verification that emitted several tokens


def _run(llm: LLM, prompt: str, params: SamplingParams, request_id: str):
    """Step the engine until the request ends -> (its last output, tokens emitted per step)."""
    engine = llm.engine
    engine.add_request(prompt, params, request_id=request_id)
    counts = [0]
    while True:
        for out in engine.step():
            counts.append(len(out.outputs[0].token_ids))
            if out.finished:
                return out, [b - a for a, b in zip(counts, counts[1:])]


def test_tokens_without_text_equal_the_tokens_with_text(engines) -> None:
    _, spec = engines
    params = [SamplingParams(temperature=t, seed=0, max_tokens=23, detokenize=d) for d in (True, False) for t in (0, 1)]
    before = spec.engine.spec_decoding_stats.num_accepted_tokens
    outs = [o.outputs[0] for o in spec.generate([PROMPTS[0]] * 4, params)]
    assert spec.engine.spec_decoding_stats.num_accepted_tokens > before
    assert [o.token_ids for o in outs[2:]] == [o.token_ids for o in outs[:2]]
    assert all(o.text for o in outs[:2]) and [o.text for o in outs[2:]] == ["", ""]
