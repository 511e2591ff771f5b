"""Bad requests get 4xx in OpenAI's error format, disconnects abort and free KV blocks, the server keeps serving."""
from __future__ import annotations

import asyncio
import gc
import threading
import time

import httpx
import pytest

from latentserve.engine.engine_config import EngineConfig
from latentserve.engine.llm_engine import LLMEngine
from latentserve.sampling_params import SamplingParams
from latentserve.server.async_engine import AsyncLLMEngine, QueueFullError
from tests.server.conftest import API_KEY, ENGINE, MODEL_NAME, LiveServer

GOOD = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def assert_error(response: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param != "any":
        assert error["param"] == param
    return error


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {**GOOD, "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {**GOOD, "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {**GOOD, "temperature": -0.5}, "temperature"),
    ("/v1/completions", {**GOOD, "top_p": 0}, "top_p"),
    ("/v1/completions", {**GOOD, "prompt": 42}, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": [1, 2, 999]}, "prompt"),  # a token id outside the vocabulary
    ("/v1/completions", {**GOOD, "prompt": []}, "prompt"),
    ("/v1/completions", {**GOOD, "prompt": "x" * 300}, "prompt"),  # longer than max_model_len (256)
    ("/v1/completions", {**GOOD, "prompt": "x" * 200, "max_tokens": 100}, "prompt"),  # no room for max_tokens
    ("/v1/completions", {**GOOD, "n": 0}, "n"),
    ("/v1/completions", {**GOOD, "logprobs": 100}, "logprobs"),
    ("/v1/completions", {**GOOD, "stop": [""]}, "stop"),
    ("/v1/completions", {**GOOD, "stream_options": {"include_usage": True}}, None),
    ("/v1/completions", {"prompt": "hi"}, "model"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, None),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
])
def test_invalid_parameters_are_400(http, path, body, param):
    error = assert_error(http.post(path, json=body), 400, param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b""])
def test_malformed_bodies_are_400(http, content):
    response = http.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    assert_error(response, 400)


def test_unknown_model_is_404(http):
    for path, body in (("/v1/completions", GOOD), ("/v1/chat/completions", CHAT)):
        error = assert_error(http.post(path, json={**body, "model": "gpt-9"}), 404, "model")
        assert "gpt-9" in error["message"] and error["code"] == "model_not_found"


def test_unknown_route_is_404_in_openai_format(http):
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.get("/v1/completions"), 405)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}])
def test_missing_or_wrong_key_is_401(server, headers):
    with httpx.Client(base_url=server.url, headers=headers) as client:
        error = assert_error(client.post("/v1/completions", json=GOOD), 401)
        assert error["type"] == "authentication_error"
        assert_error(client.get("/v1/models"), 401)
        assert client.get("/health").status_code == 200  # health and metrics stay open for probes


def test_server_keeps_serving_after_errors(http):
    http.post("/v1/completions", content=b"{oops", headers={"content-type": "application/json"})
    http.post("/v1/completions", json={**GOOD, "max_tokens": -3})
    response = http.post("/v1/completions", json=GOOD)
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] >= 1


def _aborts(http) -> int:
    line = next(l for l in http.get("/metrics").text.splitlines()
                if l.startswith("latentserve:request_success_total{") and 'finished_reason="abort"' in l)
    return int(float(line.split()[-1]))


def _wait_aborted(server, http, aborts_before: int) -> None:
    server.wait_idle()
    deadline = time.monotonic() + 10
    while _aborts(http) != aborts_before + 1:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.02)
    assert server.engine.scheduler.block_manager.usage == 0


def test_disconnect_mid_stream_aborts_and_frees_blocks(server, http, monkeypatch):
    server.wait_idle()
    step = server.engine.step
    monkeypatch.setattr(server.engine, "step", lambda: (time.sleep(0.01), step())[1])  # outlives the disconnect
    aborts = _aborts(http)
    body = {**GOOD, "max_tokens": 240, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        assert server.engine.scheduler.block_manager.usage > 0  # the request holds blocks now
    # Leaving the block closed the connection well before 240 tokens.
    _wait_aborted(server, http, aborts)


def test_disconnect_while_waiting_for_a_full_response_aborts(server, http, monkeypatch, caplog):
    server.wait_idle()
    step = server.engine.step
    monkeypatch.setattr(server.engine, "step", lambda: (time.sleep(0.01), step())[1])  # outlives the timeout
    aborts = _aborts(http)
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json={**GOOD, "max_tokens": 240, "ignore_eos": True}, timeout=0.3)
    _wait_aborted(server, http, aborts)
    time.sleep(0.1)
    gc.collect()  # a future whose exception nobody retrieved logs it when collected
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


def test_full_waiting_queue_is_503(model_dir):
    live = LiveServer(model_dir, max_waiting=1, max_num_seqs=1)
    try:
        with httpx.Client(base_url=live.url, timeout=30) as client:
            long = {**GOOD, "max_tokens": 200, "ignore_eos": True}
            results = []
            with client.stream("POST", "/v1/completions", json={**long, "stream": True}) as running:
                lines = running.iter_lines()
                while not next(lines).startswith("data: "):  # the first request runs (the only seat)
                    pass
                waiter = threading.Thread(target=lambda: results.append(client.post("/v1/completions", json=long)))
                waiter.start()
                while live.async_engine.num_waiting() < 1:  # the second one waits
                    time.sleep(0.005)
                error = assert_error(client.post("/v1/completions", json=GOOD), 503)
                assert error["type"] == "service_unavailable_error"
            waiter.join(30)
            assert results[0].status_code == 200  # the waiting one ran once the first left
    finally:
        live.stop()


def test_engine_failure_fails_requests_with_503_and_health_turns_503(model_dir):
    live = LiveServer(model_dir)

    def broken_step():
        raise RuntimeError("boom")

    live.engine.step = broken_step
    try:
        with httpx.Client(base_url=live.url, timeout=30) as client:
            error = assert_error(client.post("/v1/completions", json=GOOD), 503)
            assert "boom" in error["message"]
            streamed = client.post("/v1/completions", json={**GOOD, "stream": True})
            assert streamed.status_code == 503  # refused up front: the engine is known dead
            assert client.get("/health").status_code == 503
    finally:
        live.stop()


def test_max_waiting_counts_only_requests_beyond_the_free_seats(model_dir, monkeypatch):
    """A burst queued before the engine thread runs: as many as the engine has seats, plus max_waiting, get in."""
    engine = AsyncLLMEngine(LLMEngine(model_dir, EngineConfig(**{**ENGINE, "max_num_seqs": 8})), max_waiting=2)
    # The engine thread is not started: every request stays queued for it.
    monkeypatch.setattr(AsyncLLMEngine, "is_alive", property(lambda self: True))

    async def burst() -> int:
        accepted = 0
        for i in range(20):
            try:
                engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), f"r{i}")
                accepted += 1
            except QueueFullError:
                pass
        return accepted

    assert asyncio.run(burst()) == 8 + 2


def test_requests_aborted_while_waiting_are_counted(model_dir):
    live = LiveServer(model_dir, max_num_seqs=1)
    step = live.engine.step
    live.engine.step = lambda: (time.sleep(0.02), step())[1]  # the seat holder outlives the waiters' patience
    try:
        with httpx.Client(base_url=live.url, timeout=30) as client:
            aborts = _aborts(client)
            long = {**GOOD, "max_tokens": 200, "ignore_eos": True}
            with client.stream("POST", "/v1/completions", json={**long, "stream": True}) as running:
                lines = running.iter_lines()
                while not next(lines).startswith("data: "):  # the only seat is taken
                    pass
                for _ in range(2):  # these wait behind it, and their clients give up
                    with pytest.raises(httpx.ReadTimeout):
                        client.post("/v1/completions", json=long, timeout=0.3)
                for _ in lines:  # the seat holder ends normally: exactly the two waiting requests are aborts
                    pass
            live.wait_idle()
            deadline = time.monotonic() + 10
            while _aborts(client) != aborts + 2:
                assert time.monotonic() < deadline, f"{_aborts(client) - aborts} of 2 aborts counted"
                time.sleep(0.02)
    finally:
        live.stop()
