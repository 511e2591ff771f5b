"""Each sampling parameter through the official openai client: the served output equals offline `LLM.generate` with
the same SamplingParams, and differs from the plain output where the parameter should change it."""
from __future__ import annotations

import dataclasses

import openai
import pydantic
import pytest

from latentserve.sampling_params import SamplingParams, StructuredOutputsParams
from latentserve.server.protocol import CompletionRequest
from latentserve.server.serving import sampling_params
from tests.server.conftest import API_KEY, MODEL_NAME

PROMPT = "hello world"
# The fields the openai client sends as named arguments; the others (vLLM's extensions) go in extra_body.
OPENAI_FIELDS = {"n", "best_of", "presence_penalty", "frequency_penalty", "logit_bias", "seed", "stop", "temperature",
                 "top_p", "logprobs", "echo", "max_tokens", "stream", "user"}


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def complete(client: openai.OpenAI, prompt=PROMPT, **params):
    named = {k: v for k, v in params.items() if k in OPENAI_FIELDS}
    extra = {k: v for k, v in params.items() if k not in OPENAI_FIELDS}
    return client.completions.create(model=MODEL_NAME, prompt=prompt, extra_body=extra or None, **named)


def offline_params(params: dict) -> SamplingParams:
    """The request's fields as SamplingParams (JSON's logit_bias keys are strings)."""
    params = dict(params)
    if "logit_bias" in params:
        params["logit_bias"] = {int(k): v for k, v in params["logit_bias"].items()}
    return SamplingParams(**params)


def greedy_ids(offline, prompt=PROMPT, max_tokens=24) -> list[int]:
    return offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))[0].outputs[0].token_ids


def _cases(offline) -> list[tuple[str, dict]]:
    first, second = greedy_ids(offline)[:2]
    return [
        ("presence_penalty", {"presence_penalty": 1.5}),
        ("frequency_penalty", {"frequency_penalty": 1.5}),
        ("repetition_penalty", {"repetition_penalty": 1.8}),
        ("logit_bias", {"logit_bias": {str(first): -100}}),
        ("allowed_token_ids", {"allowed_token_ids": [t for t in range(3, 60) if t != first]}),
        ("bad_words", {"bad_words": [offline.get_tokenizer().decode([first, second])]}),
        ("stop_token_ids", {"stop_token_ids": [second]}),
        ("min_p", {"temperature": 1.0, "seed": 3, "min_p": 0.3}),
        ("top_k", {"temperature": 1.0, "seed": 3, "top_k": 2}),
        ("top_p", {"temperature": 1.0, "seed": 3, "top_p": 0.2}),
        ("truncate_prompt_tokens", {"truncate_prompt_tokens": 3}),
    ]


CASE_NAMES = ["presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids",
              "bad_words", "stop_token_ids", "min_p", "top_k", "top_p", "truncate_prompt_tokens"]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_parameter_takes_effect_as_offline(client, offline, name):
    params = dict(_cases(offline))[name]
    base = {"temperature": 0.0, "max_tokens": 24, **params}
    ref = offline.generate(PROMPT, offline_params(base))[0].outputs[0]
    plain = {k: v for k, v in base.items() if k in ("temperature", "seed", "max_tokens")}
    without = offline.generate(PROMPT, SamplingParams(**plain))[0].outputs[0]
    assert ref.text != without.text, f"{name} should change this output"
    out = complete(client, **base).choices[0]
    assert (out.text, out.finish_reason) == (ref.text, ref.finish_reason)


def test_min_tokens_and_stop_token_ids(client, offline):
    second = greedy_ids(offline)[1]
    stopped = complete(client, temperature=0, max_tokens=24, stop_token_ids=[second]).choices[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == second
    longer = complete(client, temperature=0, max_tokens=24, stop_token_ids=[second], min_tokens=5).choices[0]
    ref = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[second],
                                                  min_tokens=5))[0].outputs[0]
    assert longer.text == ref.text and len(longer.text) > len(stopped.text)


def test_include_stop_str_in_output(client, offline):
    full = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=30))[0].outputs[0].text
    stop = full[6:8]
    cut = complete(client, temperature=0, max_tokens=30, stop=[stop]).choices[0]
    kept = complete(client, temperature=0, max_tokens=30, stop=[stop], include_stop_str_in_output=True).choices[0]
    assert cut.text == full[: full.index(stop)] and kept.text == cut.text + stop
    assert kept.stop_reason == stop


def test_n_returns_distinct_seeded_samples_as_offline(client, offline):
    params = dict(temperature=1.0, seed=7, max_tokens=12, n=3)
    ref = offline.generate(PROMPT, SamplingParams(**params))[0].outputs
    out = complete(client, **params)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [c.text for c in ref]
    assert len({c.text for c in out.choices}) == 3
    assert out.usage.completion_tokens == sum(len(c.token_ids) for c in ref)


def test_best_of_returns_the_n_likeliest(client, offline):
    params = dict(temperature=1.0, seed=11, max_tokens=8, n=2, best_of=4)
    ref = offline.generate(PROMPT, SamplingParams(**params))[0].outputs
    out = complete(client, **params)
    assert [c.text for c in out.choices] == [c.text for c in ref]
    assert ref[0].cumulative_logprob >= ref[1].cumulative_logprob


def test_n_streams_every_choice(client, offline):
    params = dict(temperature=1.0, seed=5, max_tokens=10, n=2)
    ref = offline.generate(PROMPT, SamplingParams(**params))[0].outputs
    texts = {0: "", 1: ""}
    for chunk in complete(client, stream=True, **params):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert [texts[0], texts[1]] == [c.text for c in ref]


@pytest.mark.parametrize("prompts", [["hello", "the lazy dog", "abc"], [[0, 10, 7], [0, 20, 21, 22]]])
def test_batched_prompts_give_one_choice_per_prompt_per_n(client, offline, prompts):
    refs = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    out = complete(client, prompt=prompts, temperature=0, max_tokens=8, n=2)
    assert [c.index for c in out.choices] == list(range(2 * len(prompts)))
    assert [c.text for c in out.choices] == [r.outputs[0].text for r in refs for _ in range(2)]
    assert out.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs)


def test_batched_prompts_stream(client, offline):
    prompts = ["hello", "the lazy dog"]
    refs = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    texts = ["", ""]
    for chunk in complete(client, prompt=prompts, temperature=0, max_tokens=8, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [r.outputs[0].text for r in refs]


@pytest.mark.parametrize("max_tokens", [0, 5])
def test_echo_returns_the_prompt_with_its_logprobs(client, offline, max_tokens):
    k = 2
    ref = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=max(max_tokens, 1), prompt_logprobs=k,
                                                  logprobs=k))[0]
    out = complete(client, temperature=0, max_tokens=max_tokens, echo=True, logprobs=k)
    choice = out.choices[0]
    generated = ref.outputs[0].text if max_tokens else ""
    assert choice.text == PROMPT + generated
    lp = choice.logprobs
    num_prompt = len(ref.prompt_token_ids)
    assert len(lp.token_logprobs) == num_prompt + (len(ref.outputs[0].token_ids) if max_tokens else 0)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [entry[t].logprob for t, entry in zip(ref.prompt_token_ids[1:], ref.prompt_logprobs[1:])]
    assert lp.token_logprobs[1:num_prompt] == pytest.approx(expected, abs=1e-4)
    for top, entry in zip(lp.top_logprobs[1:num_prompt], ref.prompt_logprobs[1:]):
        want = sorted((lp.logprob for lp in entry.values()), reverse=True)[:k]
        assert sorted(top.values(), reverse=True) == pytest.approx(want, abs=1e-4)
    assert out.usage.completion_tokens == (len(ref.outputs[0].token_ids) if max_tokens else 0)


def test_prompt_logprobs_in_vllm_shape(client, offline):
    ref = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))[0]
    out = complete(client, temperature=0, max_tokens=2, prompt_logprobs=1)
    entries = out.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ref.prompt_token_ids)
    tokenizer = offline.get_tokenizer()
    outside_top = 0
    for token_id, entry, ref_entry in zip(ref.prompt_token_ids[1:], entries[1:], ref.prompt_logprobs[1:]):
        assert entry.keys() == {str(t) for t in ref_entry}
        for t, lp in ref_entry.items():
            assert entry[str(t)]["logprob"] == pytest.approx(lp.logprob, abs=1e-4)
            assert entry[str(t)]["rank"] == lp.rank
            assert entry[str(t)]["decoded_token"] == tokenizer.decode([t], skip_special_tokens=False)
        outside_top += ref_entry[token_id].rank > 1
    assert outside_top > 0  # prompt tokens outside the top-1 carry their true rank (vLLM's), not null


def test_chat_n_and_logit_bias(client, offline, model_dir):
    messages = [{"role": "user", "content": "Name a color!"}]
    plain = client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0, max_tokens=10)
    tokenizer = offline.get_tokenizer()
    first = tokenizer.encode(plain.choices[0].message.content, add_special_tokens=False)[0]
    biased = client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0, max_tokens=10,
                                            logit_bias={str(first): -100}, n=2)
    assert len(biased.choices) == 2 and biased.choices[0].message.content == biased.choices[1].message.content
    assert biased.choices[0].message.content != plain.choices[0].message.content


def test_user_metadata_store_are_accepted(client):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0, user="u-1",
                                    extra_body={"metadata": {"k": "v"}, "store": False})
    assert out.choices[0].text


@pytest.mark.parametrize("skip, spaces", [(True, True), (False, True), (False, False)])
def test_special_tokens_in_the_text_as_offline(client, offline, skip, spaces):
    params = dict(temperature=0.0, max_tokens=4, allowed_token_ids=[0, 2], skip_special_tokens=skip,
                  spaces_between_special_tokens=spaces)  # only <s> and <unk> can come out
    ref = offline.generate(PROMPT, SamplingParams(**params))[0].outputs[0]
    assert (ref.text == "") == skip
    assert complete(client, **params).choices[0].text == ref.text


def test_every_request_field_maps_to_its_own_sampling_param():
    """Distinct values in every field: a field mapped to another's (or dropped) shows here."""
    body = dict(model=MODEL_NAME, prompt=PROMPT, n=2, best_of=3, presence_penalty=0.3, frequency_penalty=0.7,
                repetition_penalty=1.3, temperature=0.5, top_p=0.9, top_k=5, min_p=0.05, seed=11, stop=["x"],
                stop_token_ids=[7], bad_words=["yy"], include_stop_str_in_output=True, ignore_eos=True, min_tokens=2,
                prompt_logprobs=4, skip_special_tokens=False, spaces_between_special_tokens=False,
                truncate_prompt_tokens=6, logit_bias={"5": 1.5}, allowed_token_ids=[5, 6, 8])
    got = sampling_params(CompletionRequest(**body), max_tokens=9, logprobs=3)
    expected = {**{k: v for k, v in body.items() if k not in ("model", "prompt")}, "max_tokens": 9, "logprobs": 3,
                "logit_bias": {5: 1.5}}
    default = SamplingParams()
    for field in dataclasses.fields(SamplingParams):
        if field.name == "structured_outputs":  # min_tokens excludes it: checked on its own below
            continue
        if field.name == "detokenize":  # not in vLLM's API: the server's responses are text
            assert got.detokenize is True
            with pytest.raises(pydantic.ValidationError, match="detokenize"):
                CompletionRequest(**body, detokenize=False)
            continue
        assert getattr(got, field.name) == expected[field.name], field.name
        assert getattr(got, field.name) != getattr(default, field.name), f"{field.name}: choose a non-default value"
    structured = CompletionRequest(model=MODEL_NAME, prompt=PROMPT, structured_outputs={"regex": "a+"})
    assert sampling_params(structured, 9, None).structured_outputs == StructuredOutputsParams(regex="a+")


def _listed(logprobs) -> list[str]:
    return [t for lp in logprobs for t in lp.tokens]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("include", [False, True])
def test_logprobs_list_no_token_of_a_stripped_stop_string(client, offline, stream, include):
    full = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=30))[0].outputs[0].text
    stop = full[6]  # the character-level tokenizer: one token per character
    cut = full[: full.index(stop) + include]
    body = dict(temperature=0, max_tokens=30, stop=[stop], logprobs=1, include_stop_str_in_output=include)
    if stream:
        chunks = [c.choices[0] for c in complete(client, stream=True, **body)]
        text, listed = "".join(c.text for c in chunks), _listed(c.logprobs for c in chunks if c.logprobs)
    else:
        choice = complete(client, **body).choices[0]
        text, listed = choice.text, choice.logprobs.tokens
    assert text == cut and listed == list(cut)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_list_no_token_of_a_stripped_stop_string(client, stream):
    messages = [{"role": "user", "content": PROMPT}]
    full = client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0,
                                          max_tokens=30).choices[0].message.content
    stop = full[6]
    body = dict(model=MODEL_NAME, messages=messages, temperature=0, max_tokens=30, stop=[stop], logprobs=True)
    if stream:
        chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **body) if c.choices]
        text = "".join(c.delta.content or "" for c in chunks)
        listed = [t.token for c in chunks if c.logprobs for t in c.logprobs.content]
    else:
        choice = client.chat.completions.create(**body).choices[0]
        text, listed = choice.message.content, [t.token for t in choice.logprobs.content]
    assert text == full[: full.index(stop)] and listed == list(text)


def _streamed_usage(chunks) -> tuple[dict, list]:
    chunks = list(chunks)
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    return chunks[-1].usage, chunks


def test_streamed_usage_of_batched_prompts_and_n_equals_the_non_streamed(client):
    """Every prompt of a batch and every one of the n samples counts (prompts of different lengths, ignore_eos)."""
    body = dict(prompt=["hello", "the lazy dog", "abc"], temperature=1.0, seed=4, max_tokens=6, n=2, ignore_eos=True)
    whole = complete(client, **body).usage
    streamed, chunks = _streamed_usage(complete(client, stream=True, stream_options={"include_usage": True}, **body))
    assert streamed == whole and whole.completion_tokens == 3 * 2 * 6
    assert {c.choices[0].index for c in chunks[:-1]} == set(range(6))


def test_streamed_chat_usage_with_n_equals_the_non_streamed(client):
    body = dict(model=MODEL_NAME, messages=[{"role": "user", "content": PROMPT}], temperature=1.0, seed=4,
                max_tokens=7, n=3, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**body).usage
    streamed, _ = _streamed_usage(client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                                 **body))
    assert streamed == whole and whole.completion_tokens == 3 * 7
