"""vLLM's request fields beyond OpenAI's: return_token_ids, return_tokens_as_token_ids, add_special_tokens,
request_id, priority, and response_format on completions; checked against the offline engine and transformers'
tokenizer."""
from __future__ import annotations

import json

import httpx
import jsonschema
from tokenizers import Tokenizer

from latentserve.sampling_params import SamplingParams
from tests.server.conftest import MODEL_NAME, LiveServer
from tests.server.test_openai_api import MESSAGES, chat_prompt_ids

PROMPT = "the lazy dog"
BOS = 0  # conftest's tokenizer: "<s>", which tokenizer_config.json asks to add


def _ids(model_dir, text: str) -> list[int]:
    """`text`'s token ids without special tokens, from the tokenizers library alone."""
    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def _post(http, path: str, **body) -> dict:
    response = http.post(path, json={"model": MODEL_NAME, "temperature": 0, "max_tokens": 12, **body})
    assert response.status_code == 200, response.text
    return response.json()


def _events(http, path: str, **body) -> list[dict]:
    response = http.post(path, json={"model": MODEL_NAME, "temperature": 0, "max_tokens": 12, "stream": True, **body})
    assert response.status_code == 200, response.text
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]


def test_completion_token_ids(http, offline, model_dir):
    reference = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12, n=1))[0]
    prompt_ids = [BOS] + _ids(model_dir, PROMPT)
    choice = _post(http, "/v1/completions", prompt=PROMPT, return_token_ids=True)["choices"][0]
    assert choice["prompt_token_ids"] == prompt_ids == reference.prompt_token_ids
    assert choice["token_ids"] == reference.outputs[0].token_ids
    assert _post(http, "/v1/completions", prompt=PROMPT)["choices"][0]["token_ids"] is None  # only when asked
    events = _events(http, "/v1/completions", prompt=PROMPT, return_token_ids=True, n=2, temperature=1.0, seed=3)
    for index in (0, 1):
        mine = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == index]
        assert mine[0]["prompt_token_ids"] == prompt_ids
        assert all(c["prompt_token_ids"] is None for c in mine[1:])
        whole = _post(http, "/v1/completions", prompt=PROMPT, return_token_ids=True, n=2, temperature=1.0,
                      seed=3)["choices"][index]
        assert sum((c["token_ids"] for c in mine), []) == whole["token_ids"]


def test_chat_token_ids(http, offline, model_dir):
    prompt_ids = chat_prompt_ids(model_dir, MESSAGES)
    reference = offline.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    body = _post(http, "/v1/chat/completions", messages=MESSAGES, return_token_ids=True)
    assert body["prompt_token_ids"] == prompt_ids
    assert body["choices"][0]["token_ids"] == reference.token_ids
    events = _events(http, "/v1/chat/completions", messages=MESSAGES, return_token_ids=True)
    assert events[0]["prompt_token_ids"] == prompt_ids and all(e["prompt_token_ids"] is None for e in events[1:])
    assert sum((e["choices"][0]["token_ids"] for e in events if e["choices"]), []) == reference.token_ids


def test_tokens_as_token_ids(http):
    plain = _post(http, "/v1/completions", prompt=PROMPT, logprobs=2, echo=True)["choices"][0]["logprobs"]
    named = _post(http, "/v1/completions", prompt=PROMPT, logprobs=2, echo=True, return_token_ids=True,
                  return_tokens_as_token_ids=True)["choices"][0]
    ids = named["prompt_token_ids"] + named["token_ids"]
    assert named["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids]
    assert named["logprobs"]["text_offset"] == plain["text_offset"]  # offsets still count characters
    assert [v for v in named["logprobs"]["token_logprobs"]] == [v for v in plain["token_logprobs"]]
    for top in named["logprobs"]["top_logprobs"][1:]:
        assert all(key.startswith("token_id:") for key in top)
    chat_plain = _post(http, "/v1/chat/completions", messages=MESSAGES, logprobs=True, top_logprobs=2)
    chat = _post(http, "/v1/chat/completions", messages=MESSAGES, logprobs=True, top_logprobs=2,
                 return_token_ids=True, return_tokens_as_token_ids=True)
    content, plain_content = chat["choices"][0]["logprobs"]["content"], chat_plain["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in chat["choices"][0]["token_ids"]]
    assert [c["bytes"] for c in content] == [c["bytes"] for c in plain_content]  # the bytes stay the text's


def test_add_special_tokens(http, model_dir):
    off = _post(http, "/v1/completions", prompt=PROMPT, add_special_tokens=False, return_token_ids=True)
    assert off["choices"][0]["prompt_token_ids"] == _ids(model_dir, PROMPT)
    # A template that writes no BOS itself: chat adds none unless asked to (vLLM's default for chat).
    server = LiveServer(model_dir, chat_template="{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    try:
        text = "".join(m["content"] + "\n" for m in MESSAGES)
        for add, expected in ((False, _ids(model_dir, text)), (True, [BOS] + _ids(model_dir, text))):
            response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
                "model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1, "add_special_tokens": add,
                "return_token_ids": True})
            assert response.json()["prompt_token_ids"] == expected
    finally:
        server.stop()


def test_request_id_names_the_answer(http):
    same = [_post(http, "/v1/completions", prompt=PROMPT, request_id="job-7") for _ in range(2)]
    assert [body["id"] for body in same] == ["cmpl-job-7", "cmpl-job-7"]
    assert _post(http, "/v1/chat/completions", messages=MESSAGES, request_id="job-7")["id"] == "chatcmpl-job-7"
    events = _events(http, "/v1/chat/completions", messages=MESSAGES, request_id="job-8")
    assert {e["id"] for e in events} == {"chatcmpl-job-8"}


def test_priority_is_first_come_first_served(http):
    assert _post(http, "/v1/completions", prompt=PROMPT, priority=0)["choices"]
    response = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, "priority": 1})
    assert response.status_code == 400
    assert "first come, first served" in response.json()["error"]["message"]


def test_completion_response_format(http):
    schema = {"enum": [[7], [42, 3], 1001]}  # the tokenizer has no '"'
    body = _post(http, "/v1/completions", prompt=PROMPT, max_tokens=40,
                 response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    jsonschema.validate(json.loads(body["choices"][0]["text"]), schema)
    assert body["choices"][0]["finish_reason"] == "stop"


def test_the_whole_vocabulary_of_logprobs(http, model_dir):
    """-1 (vLLM's): every token's logprob, refused under the default --max-logprobs."""
    refused = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, "prompt_logprobs": -1})
    assert refused.status_code == 400 and "exceeds this engine's max_logprobs=20" in refused.json()["error"]["message"]
    server = LiveServer(model_dir, max_logprobs=-1)
    try:
        body = {"model": MODEL_NAME, "max_tokens": 3, "temperature": 0}
        completion = httpx.post(f"{server.url}/v1/completions", timeout=60,
                                json={**body, "prompt": PROMPT, "prompt_logprobs": -1}).json()
        positions = completion["choices"][0]["prompt_logprobs"][1:]
        assert positions and all(len(p) == 96 for p in positions)  # the tokenizer's vocabulary
        assert all(sorted(e["rank"] for e in p.values()) == list(range(1, 97)) for p in positions)
        chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                          json={**body, "messages": MESSAGES, "logprobs": True, "top_logprobs": -1}).json()
        content = chat["choices"][0]["logprobs"]["content"]
        assert content and all(len(c["top_logprobs"]) == 96 for c in content)
        assert all(c["top_logprobs"][0]["logprob"] == c["logprob"] for c in content)  # greedy: the top one
    finally:
        server.stop()


def test_continuous_usage_stats(http):
    options = {"include_usage": True, "continuous_usage_stats": True}
    prompts = [PROMPT, "a quick brown fox jumps"]
    whole = _post(http, "/v1/completions", prompt=prompts, return_token_ids=True)
    events = _events(http, "/v1/completions", prompt=prompts, stream_options=options)
    for index, choice in enumerate(whole["choices"]):
        mine = [e for e in events if e["choices"] and e["choices"][0]["index"] == index]
        counts = [e["usage"]["completion_tokens"] for e in mine]
        assert counts == sorted(counts) and counts[-1] == len(choice["token_ids"])
        assert {e["usage"]["prompt_tokens"] for e in mine} == {len(choice["prompt_token_ids"])}
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
    chat = _events(http, "/v1/chat/completions", messages=MESSAGES, stream_options=options)
    assert all(e["usage"] is not None for e in chat)
    assert chat[-2]["usage"]["completion_tokens"] == chat[-1]["usage"]["completion_tokens"]
    refused = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, "stream": True,
                                                 "stream_options": {"continuous_usage_stats": True}})
    assert refused.status_code == 400 and "needs include_usage=true" in refused.json()["error"]["message"]
