"""The official openai client against a live server: outputs equal offline `LLM.generate` on the same checkpoint."""
from __future__ import annotations

import re

import openai
import pytest
from transformers import AutoTokenizer

from latentserve.sampling_params import SamplingParams
from tests.server.conftest import API_KEY, MODEL_NAME

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color!"}]


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def reference(offline, prompt, **params):
    """The offline completion of `prompt` (greedy unless params say otherwise)."""
    return offline.generate(prompt, SamplingParams(**{"temperature": 0.0, **params}))[0]


def chat_prompt_ids(model_dir, messages) -> list[int]:
    """The conversation as transformers' own chat templating tokenizes it: an independent reference."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])


@pytest.mark.parametrize("prompt", ["hello world", [0, 10, 7, 14, 14, 17]])
def test_completion_matches_offline(client, offline, prompt):
    ref = reference(offline, prompt, max_tokens=24, logprobs=2)
    out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0, logprobs=2)
    ref_completion, tokenizer = ref.outputs[0], offline.get_tokenizer()
    choice = out.choices[0]
    assert choice.text == ref_completion.text
    assert choice.finish_reason == ref_completion.finish_reason
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref_completion.token_ids)
    decoded = [tokenizer.decode([t], skip_special_tokens=False) for t in ref_completion.token_ids]
    assert choice.logprobs.tokens == decoded
    expected = [lp[t].logprob for t, lp in zip(ref_completion.token_ids, ref_completion.logprobs)]
    assert choice.logprobs.token_logprobs == pytest.approx(expected, abs=1e-4)
    for top, chosen in zip(choice.logprobs.top_logprobs, choice.logprobs.token_logprobs):
        assert len(top) <= 2 and max(top.values()) == pytest.approx(chosen, abs=1e-4)  # greedy: the chosen is the top


def test_completion_stream_matches_offline(client, offline):
    ref = reference(offline, "the lazy dog", max_tokens=30).outputs[0]
    chunks = list(client.completions.create(model=MODEL_NAME, prompt="the lazy dog", max_tokens=30, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == ref.finish_reason and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert len({c.id for c in chunks}) == 1


@pytest.mark.parametrize("max_param", ["max_tokens", "max_completion_tokens"])
def test_chat_matches_offline(client, offline, model_dir, max_param):
    ref = reference(offline, chat_prompt_ids(model_dir, MESSAGES), max_tokens=20)
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0, **{max_param: 20})
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.outputs[0].text
    assert out.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_chat_stream_matches_offline(client, offline, model_dir):
    ref = reference(offline, chat_prompt_ids(model_dir, MESSAGES), max_tokens=25).outputs[0]
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0, max_tokens=25,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_chat_top_logprobs(client, offline, model_dir):
    ref = reference(offline, chat_prompt_ids(model_dir, MESSAGES), max_tokens=8, logprobs=3).outputs[0]
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0, max_tokens=8,
                                         logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == len(ref.token_ids)
    for entry, token_id, lps in zip(content, ref.token_ids, ref.logprobs):
        assert entry.logprob == pytest.approx(lps[token_id].logprob, abs=1e-4)
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx(sorted((lp.logprob for lp in lps.values()), reverse=True)[:3], abs=1e-4)
        assert bytes(entry.bytes).decode() == entry.token


def test_stop_string_cuts_the_text(client, offline):
    full = reference(offline, "hello", max_tokens=30).outputs[0].text
    stop = full[6:8]
    out = client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=30, temperature=0, stop=[stop])
    assert out.choices[0].text == full[: full.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_seeded_sampling_matches_offline(client, offline):
    kwargs = dict(temperature=1.0, top_p=0.9, top_k=20, seed=1234, max_tokens=16)
    ref = reference(offline, "hello", **kwargs).outputs[0].text
    extra = {"top_k": kwargs.pop("top_k")}
    texts = [client.completions.create(model=MODEL_NAME, prompt="hello", extra_body=extra, **kwargs).choices[0].text
             for _ in range(2)]
    assert texts == [ref, ref]


def test_models_and_health(client, http):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert http.get("/health").status_code == 200


def _metric(text: str, name: str) -> float:
    """A sample of /metrics: `name` is vLLM's metric name, with its labels other than model_name."""
    base, _, labels = name.partition("{")
    labels = ",".join(sorted([f'model_name="{MODEL_NAME}"'] + ([labels.rstrip("}")] if labels else [])))
    match = re.search(rf"^latentserve:{re.escape(base)}{{{re.escape(labels)}}} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_metrics_count_requests_and_tokens(client, http, server):
    server.wait_idle()
    before = http.get("/metrics").text
    out = client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=7, temperature=0, extra_body={
        "ignore_eos": True})
    server.wait_idle()
    after = http.get("/metrics").text
    assert http.get("/metrics").headers["content-type"].startswith("text/plain")
    diff = {name: _metric(after, name) - _metric(before, name) for name in (
        'request_success_total{finished_reason="length"}', "prompt_tokens_total", "generation_tokens_total",
        "time_to_first_token_seconds_count", "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count",
        "request_generation_tokens_sum", "request_params_max_tokens_sum")}
    assert diff == {'request_success_total{finished_reason="length"}': 1,
                    "prompt_tokens_total": out.usage.prompt_tokens, "generation_tokens_total": 7,
                    "time_to_first_token_seconds_count": 1, "inter_token_latency_seconds_count": 6,
                    "e2e_request_latency_seconds_count": 1, "request_generation_tokens_sum": 7,
                    "request_params_max_tokens_sum": 7}
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert _metric(after, gauge) == 0


def test_metrics_under_vllm_names():
    """With the vllm prefix, the exposition has vLLM's exact metric names and labels."""
    from prometheus_client.parser import text_string_to_metric_families

    from latentserve.server.metrics import Metrics

    metrics = Metrics(lambda: {"running": 2, "waiting": 1, "kv_cache_usage": 0.5}, "m", prefix="vllm")
    metrics.observe_finished("stop", 5, 3, 0.2)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:request_success", "vllm:prompt_tokens", "vllm:generation_tokens",
            "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
            "vllm:e2e_request_latency_seconds"} <= set(families)
    success = {s.labels["finished_reason"]: s.value for s in families["vllm:request_success"].samples}
    assert success == {"stop": 1, "length": 0, "abort": 0, "error": 0}
    running = families["vllm:num_requests_running"].samples[0]
    assert (running.labels, running.value) == ({"model_name": "m"}, 2)
