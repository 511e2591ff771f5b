"""A bad-input battery: every response is a 4xx in OpenAI's error format naming what is wrong, never a 500, and the
server answers /health throughout; plus the size limit, the tokenizer endpoints and the serve flags."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from latentserve.cli import make_parser
from latentserve.cli.serve import API_KEY_ENV, server_config
from tests.server.conftest import MODEL_NAME, LiveServer
from tests.server.test_errors import CHAT, GOOD, assert_error

SURROGATE = '"\\ud800"'  # JSON text of a lone surrogate: valid JSON, not valid Unicode


def raw(body: dict, field: str, json_value: str) -> bytes:
    """`body` as JSON with `field` set to a raw JSON value (to send what json.dumps would not write)."""
    text = json.dumps({**body, field: "PLACEHOLDER"})
    return text.replace('"PLACEHOLDER"', json_value).encode()


BATTERY = [
    # (path, body as dict or raw JSON bytes, status, param)
    ("/v1/completions", raw(GOOD, "prompt", SURROGATE), 400, "prompt"),
    ("/v1/completions", raw(GOOD, "prompt", f'["ok", {SURROGATE}]'), 400, "prompt[1]"),
    ("/v1/completions", raw(GOOD, "stop", f"[{SURROGATE}]"), 400, "stop[0]"),
    ("/v1/completions", raw(GOOD, "bad_words", f"[{SURROGATE}]"), 400, "bad_words[0]"),
    ("/v1/chat/completions", raw(CHAT, "messages", f'[{{"role": "user", "content": {SURROGATE}}}]'), 400,
     "messages[0].content"),
    ("/v1/completions", raw(GOOD, "temperature", "NaN"), 400, "temperature"),
    ("/v1/completions", raw(GOOD, "top_p", "Infinity"), 400, "top_p"),
    ("/v1/completions", {**GOOD, "frobnicate": 1}, 400, "frobnicate"),
    ("/v1/chat/completions", {**CHAT, "frobnicate": 1}, 400, "frobnicate"),
    ("/v1/completions", {**GOOD, "suffix": "tail"}, 400, "suffix"),
    ("/v1/completions", {**GOOD, "use_beam_search": True}, 400, "use_beam_search"),
    ("/v1/completions", {**GOOD, "guided_json": {"type": "object"}}, 400, "guided_json"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, 400, "response_format"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "auto"}, 400, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "continue_final_message": True}, 400, "continue_final_message"),
    ("/v1/completions", {**GOOD, "min_p": 5}, 400, "min_p"),
    ("/v1/completions", {**GOOD, "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {**GOOD, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {**GOOD, "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/completions", {**GOOD, "logit_bias": {"100000": 1}}, 400, "logit_bias"),
    ("/v1/completions", {**GOOD, "logit_bias": {"5": 100.5}}, 400, "logit_bias"),  # OpenAI's range: [-100, 100]
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"5": -101}}, 400, "logit_bias"),
    ("/v1/completions", {**GOOD, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": ["ok", ""]}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "stream": "yes"}, 400, "stream"),  # booleans are JSON's true and false only
    ("/v1/completions", {**GOOD, "echo": 1}, 400, "echo"),
    ("/v1/chat/completions", {**CHAT, "logprobs": "true"}, 400, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": "yes"}}, 400,
     "stream_options"),
    ("/v1/completions", {**GOOD, "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ("/v1/completions", {**GOOD, "stop_token_ids": [100000]}, 400, "stop_token_ids"),
    ("/v1/completions", {**GOOD, "n": 2, "best_of": 1}, 400, "best_of"),
    ("/v1/completions", {**GOOD, "n": 1, "best_of": 2, "stream": True}, 400, "best_of"),
    ("/v1/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),  # 0 only with echo
    ("/v1/completions", {**GOOD, "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens"),
    ("/v1/completions", {**GOOD, "prompt": [[1, 2], []]}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": [[1, 2], [999]]}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": ["x" * 300, "ok"]}, 400, "prompt"),
    ("/v1/completions", {**GOOD, "n": "two"}, 400, "n"),
    ("/v1/completions", {**GOOD, "echo": "maybe"}, 400, "echo"),
    ("/v1/completions", b'{"model": "tiny-v3", "prompt": "a",', 400, None),
    ("/v1/models/nope", None, 404, "model"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, None),
    ("/tokenize", raw({}, "prompt", SURROGATE), 400, "prompt"),
    ("/tokenize", {"prompt": "a", "extra": 1}, 400, "extra"),
    ("/detokenize", {"tokens": [1, 100000]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
]


@pytest.mark.parametrize("path, body, status, param", BATTERY)
def test_bad_input_is_4xx_naming_the_field_and_the_server_stays_healthy(http, path, body, status, param):
    if body is None:
        response = http.get(path)
    elif isinstance(body, bytes):
        response = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = http.post(path, json=body)
    error = assert_error(response, status, param)
    if param is not None:
        assert param.split("[")[0].split(".")[0] in error["message"]
    assert http.get("/health").status_code == 200


def test_nan_temperature_says_finite(http):
    error = assert_error(http.post("/v1/completions", content=raw(GOOD, "temperature", "NaN"),
                                   headers={"content-type": "application/json"}), 400, "temperature")
    assert "finite" in error["message"]


MAX_BYTES = 1 << 20
BODY_READ_TIMEOUT = 2.0  # generous: the 1 MiB bodies below must not stall this long


@pytest.fixture(scope="module")
def small_body_server(model_dir):
    live = LiveServer(model_dir, max_request_bytes=MAX_BYTES, body_read_timeout=BODY_READ_TIMEOUT)
    yield live
    live.stop()


@pytest.fixture
def small_http(small_body_server):
    with httpx.Client(base_url=small_body_server.url, timeout=30) as client:
        yield client


def test_oversized_bodies_are_413_by_length_or_as_they_stream(small_http):
    body = json.dumps({**GOOD, "prompt": "x" * MAX_BYTES}).encode()
    headers = {"content-type": "application/json"}
    error = assert_error(small_http.post("/v1/completions", content=body, headers=headers), 413)
    assert str(MAX_BYTES) in error["message"]
    half = len(body) // 2
    assert_error(small_http.post("/v1/completions", content=iter([body[:half], body[half:]]), headers=headers), 413)
    assert small_http.post("/v1/completions", json=GOOD).status_code == 200


def test_a_body_shorter_than_its_content_length_gets_408(small_body_server, small_http):
    port = int(small_body_server.url.rsplit(":", 1)[1])
    body = json.dumps(GOOD).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) + 10}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10 * BODY_READ_TIMEOUT) as sock:
        sock.sendall(head + body)  # 10 bytes short
        start = time.monotonic()
        answer = b""
        while b"stopped arriving" not in answer:  # the head and the body may come in separate segments
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        elapsed = time.monotonic() - start
    answer = answer.decode()
    assert answer.startswith("HTTP/1.1 408"), answer
    assert "stopped arriving" in answer and elapsed < 5 * BODY_READ_TIMEOUT
    assert small_http.post("/v1/completions", json=GOOD).status_code == 200


def test_health_answers_while_a_maximum_size_prompt_is_tokenized(small_http):
    http = small_http
    prompt = "abc def " * (MAX_BYTES // 8 - 16)  # just under the body limit
    result = {}

    def big() -> None:
        result["response"] = http.post("/v1/completions", json={**GOOD, "prompt": prompt}, timeout=120)
        result["health_answers"] = answered

    answered = 0
    sender = threading.Thread(target=big)
    sender.start()
    while sender.is_alive():
        assert http.get("/health", timeout=10).status_code == 200  # a generous bound, not a latency check
        answered += 1
    sender.join()
    assert_error(result["response"], 400, "prompt")  # far past max_model_len
    assert result["health_answers"] >= 1


def test_models_by_id_version_and_ping(http):
    card = http.get(f"/v1/models/{MODEL_NAME}").json()
    assert card["id"] == MODEL_NAME and card["object"] == "model" and card["max_model_len"] == 256
    assert http.get("/version").json()["version"]
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200


def test_tokenize_and_detokenize_match_the_tokenizer(http, offline):
    tokenizer = offline.get_tokenizer()
    out = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": "hello world", "return_token_strs": True}).json()
    expected = tokenizer.encode("hello world")
    assert out["tokens"] == expected and out["count"] == len(expected) and out["max_model_len"] == 256
    assert "".join(out["token_strs"][1:]) == "hello world"
    assert http.post("/detokenize", json={"tokens": expected[1:]}).json() == {"prompt": "hello world"}
    messages = [{"role": "user", "content": "hi"}]
    chat = http.post("/tokenize", json={"messages": messages}).json()
    completion = http.post("/v1/chat/completions", json={**CHAT, "messages": messages, "max_tokens": 1}).json()
    assert chat["count"] == completion["usage"]["prompt_tokens"]


def test_api_key_from_the_environment(monkeypatch):
    parser = make_parser()
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert server_config(parser.parse_args(["serve"])).api_key == "from-env"
    assert server_config(parser.parse_args(["serve", "--api-key", "flag"])).api_key == "flag"
    monkeypatch.delenv(API_KEY_ENV)
    config = server_config(parser.parse_args(["serve", "--drain-timeout", "2.5", "--max-request-bytes", "100",
                                              "--body-read-timeout", "3"]))
    assert (config.api_key, config.drain_timeout, config.max_request_bytes, config.body_read_timeout) == (
        None, 2.5, 100, 3.0)
