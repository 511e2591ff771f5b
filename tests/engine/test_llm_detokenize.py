"""SamplingParams(detokenize=False) on the embedded model: the same tokens as with text, no text, no decoded tokens in
logprobs, and no detokenizer run at all."""
from __future__ import annotations

import pytest

from latentserve import LLM, SamplingParams
from latentserve.engine.detokenizer import IncrementalDetokenizer
from latentserve.structured_params import StructuredOutputsParams

PROMPTS = ["And God said", "In the beginning", "The LORD is my shepherd"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_num_seqs=8, num_kv_blocks=128, dtype="float32")  # the embedded model


def run(llm: LLM, detokenize: bool, **kwargs):
    params = [SamplingParams(detokenize=detokenize, seed=i, **kwargs) for i in range(len(PROMPTS))]
    return llm.generate(PROMPTS, params, use_tqdm=False)


def check_same_tokens_without_text(with_text, without_text) -> None:
    for a, b in zip(with_text, without_text, strict=True):
        assert len(a.outputs) == len(b.outputs)
        for x, y in zip(a.outputs, b.outputs):
            assert y.token_ids == x.token_ids and (y.finish_reason, y.stop_reason) == (x.finish_reason, x.stop_reason)
            assert x.text and y.text == ""


@pytest.mark.parametrize("kwargs", [
    dict(temperature=0.0, max_tokens=12),
    dict(temperature=1.0, max_tokens=12, ignore_eos=True),
    dict(temperature=1.0, max_tokens=8, n=2, best_of=3),  # parallel samples ranked by cumulative logprob
    dict(temperature=0.8, max_tokens=16, bad_words=[","], stop_token_ids=[18]),  # token 16 is ",", 18 "."
])
def test_same_token_ids_and_no_text(llm, kwargs):
    check_same_tokens_without_text(run(llm, True, **kwargs), run(llm, False, **kwargs))


def test_logprobs_keep_their_values_without_decoded_tokens(llm):
    kwargs = dict(temperature=1.0, max_tokens=8, logprobs=3, prompt_logprobs=2)
    with_text, without_text = run(llm, True, **kwargs), run(llm, False, **kwargs)
    check_same_tokens_without_text(with_text, without_text)
    for a, b in zip(with_text, without_text):
        entries = [(x, y) for x, y in zip(a.prompt_logprobs + a.outputs[0].logprobs,
                                          b.prompt_logprobs + b.outputs[0].logprobs, strict=True) if x is not None]
        assert len(entries) == len(a.prompt_token_ids) - 1 + 8
        for x, y in entries:
            assert {t: (lp.logprob, lp.rank) for t, lp in y.items()} == {t: (lp.logprob, lp.rank) for t, lp in x.items()}
            assert all(lp.decoded_token for lp in x.values()) and all(lp.decoded_token is None for lp in y.values())


def test_structured_outputs_constrain_the_token_ids(llm):
    tokenizer = llm.get_tokenizer()
    spec = StructuredOutputsParams(choice=["yea", "nay", "amen"])
    kwargs = dict(temperature=1.0, max_tokens=20, structured_outputs=spec)
    with_text, without_text = run(llm, True, **kwargs), run(llm, False, **kwargs)
    check_same_tokens_without_text(with_text, without_text)
    for out in without_text:
        assert tokenizer.decode(out.outputs[0].token_ids) in spec.choice and out.outputs[0].finish_reason == "stop"


def test_no_detokenizer_is_built_or_run(llm, monkeypatch):
    calls = []
    for name in ("add_token", "flush", "token_text", "get_output_text"):
        method = getattr(IncrementalDetokenizer, name)
        monkeypatch.setattr(IncrementalDetokenizer, name,
                            lambda self, *a, _m=method, _n=name, **k: calls.append(_n) or _m(self, *a, **k))
    kwargs = dict(temperature=0.0, max_tokens=6, logprobs=2, prompt_logprobs=2, n=2)
    run(llm, False, **kwargs)
    assert calls == []
    assert llm.engine.make_request(PROMPTS[0], SamplingParams(detokenize=False)).detokenizer is None
    run(llm, True, **kwargs)  # the counter does see a detokenizing request
    assert {"add_token", "flush", "token_text", "get_output_text"} <= set(calls)
