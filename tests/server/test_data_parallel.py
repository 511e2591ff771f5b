"""Two data-parallel ranks (gloo, experts split) behind the per-step engine and the server: the outputs of one
process, step by step and over HTTP, aborts on the owning rank, bad requests refused while others run, and a dead
rank failing every request. One pair of ranks serves the whole module; the last test ends it."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from latentserve.distributed.launch import GRACE_S, WorkerFailure
from latentserve.engine.llm import LLM
from latentserve.sampling_params import SamplingParams
from latentserve.server.async_engine import HEALTH_CHECK_S
from tests.distributed import rpc
from tests.distributed.helpers import process_gone, rank_steps
from tests.server.conftest import ENGINE, MODEL_NAME, LiveServer

DP = dict(data_parallel_size=2, enable_expert_parallel=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 17, 33, 2, 9, 41], [3, 88], list(range(10, 40)), [70, 71, 72]]


@pytest.fixture(scope="module")
def dp_llm(model_dir):
    llm = LLM(model=model_dir, **ENGINE, **DP)
    llm.dp_engine.collective_rpc(rpc.log_steps)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def dp_server(model_dir, dp_llm):
    live = LiveServer(model_dir, engine=dp_llm.engine)
    yield live
    live.stop()


@pytest.fixture
def dp_http(dp_server):
    with httpx.Client(base_url=dp_server.url, timeout=60) as client:
        yield client


def _run(engine, prompts, params) -> list[list[list[int]]]:
    """Add the prompts, step until done; per prompt, its token ids after every step that touched it."""
    ids = [engine.add_request(p, params) for p in prompts]
    history: dict[str, list[list[int]]] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for output in engine.step():
            history[output.request_id].append(output.outputs[0].token_ids)
    return [history[i] for i in ids]



def test_per_step_outputs_match_one_process(dp_llm, offline):
    """Each step's snapshot of each request equals the one-process engine's; the ranks step in lockstep."""
    one = _run(offline.engine, PROMPTS, GREEDY)
    rank_steps(dp_llm)
    dp = _run(dp_llm.engine, PROMPTS, GREEDY)
    assert dp == one and all(len(h[-1]) == GREEDY.max_tokens for h in one)
    rank0, rank1 = rank_steps(dp_llm)
    assert len(rank0) == len(rank1) > 0  # lockstep: one step on every rank per step command
    assert sum(t for t, _ in rank0) > 0 and sum(t for t, _ in rank1) > 0  # both ranks had requests
    assert dp_llm.engine.step() == [] and rank_steps(dp_llm) == [[], []]  # nothing to do: no rank steps


def _logprob_summary(entries):
    return [None if e is None else {t: (round(lp.logprob, 4), lp.rank, lp.decoded_token) for t, lp in e.items()}
            for e in entries]


def test_offline_prompt_dicts_and_chat_on_the_ranks(dp_llm, offline):
    """LLM.generate's prompt dicts and LLM.chat run on the ranks, their outputs' Logprob objects sent back: as in
    one process."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    ours = dp_llm.generate([{"prompt": "Hello there"}, {"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    theirs = offline.generate(["Hello there", PROMPTS[0]], params, use_tqdm=False)
    for a, b in zip(ours, theirs, strict=True):
        assert (a.prompt, a.prompt_token_ids, a.outputs[0].token_ids) == (b.prompt, b.prompt_token_ids,
                                                                          b.outputs[0].token_ids)
        assert _logprob_summary(a.prompt_logprobs) == _logprob_summary(b.prompt_logprobs)
        assert _logprob_summary(a.outputs[0].logprobs) == _logprob_summary(b.outputs[0].logprobs)
    assert ours[0].outputs[0].logprobs[0][ours[0].outputs[0].token_ids[0]].decoded_token is not None
    conversations = [[{"role": "user", "content": "Hi!"}],
                     [{"role": "user", "content": [{"type": "text", "text": "Name "}, {"type": "text", "text": "one"}]}]]
    ours = dp_llm.chat(conversations, GREEDY, use_tqdm=False)
    theirs = offline.chat(conversations, GREEDY, use_tqdm=False)
    assert [(o.prompt, o.outputs[0].token_ids) for o in ours] == [(o.prompt, o.outputs[0].token_ids) for o in theirs]
    assert ours[1].prompt == "<s><|user|>Name one\n<|assistant|>"


def test_one_request_runs_on_one_rank_while_the_other_steps_empty(dp_llm, offline):
    rank_steps(dp_llm)
    ref = offline.generate(PROMPTS[:1], GREEDY)[0].outputs[0].token_ids
    assert _run(dp_llm.engine, PROMPTS[:1], GREEDY)[0][-1] == ref
    steps = rank_steps(dp_llm)
    busy = [s for s in steps if any(t for t, _ in s)]
    assert len(busy) == 1 and len(steps[0]) == len(steps[1])
    idle = steps[1 - steps.index(busy[0])]
    assert all(t == 0 for t, _ in idle) and all(t > 0 for t, _ in busy[0])


def test_bad_prompt_is_refused_like_one_process_and_others_go_on(dp_llm, offline):
    engine = dp_llm.engine
    good = engine.add_request(PROMPTS[0], GREEDY)
    for bad_prompt, bad_params in [([1, 500], GREEDY), ([1, 2], "greedy"), ([1] * 300, GREEDY), ([], GREEDY)]:
        with pytest.raises(ValueError) as expected:
            offline.engine.add_request(bad_prompt, bad_params, "bad")
        with pytest.raises(ValueError) as got:
            engine.add_request(bad_prompt, bad_params, "bad")
        assert str(got.value) == str(expected.value)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(PROMPTS[1], GREEDY, good)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.request_id for o in outputs if o.finished] == [good]
    assert outputs[-1].outputs[0].token_ids == offline.generate(PROMPTS[:1], GREEDY)[0].outputs[0].token_ids


def test_abort_frees_the_owning_rank_and_generate_waits_for_no_one(dp_llm, offline):
    engine = dp_llm.engine
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS[:2]]
    engine.step()
    with pytest.raises(RuntimeError, match="2 request"):
        dp_llm.generate(PROMPTS[:1], GREEDY)
    loads = engine.dp_engine.loads
    assert [load.num_running for load in loads] == [1, 1] and all(load.kv_cache_usage > 0 for load in loads)
    owner = engine.dp_engine._owner[ids[0]]
    engine.abort_request(ids[0])
    engine.abort_request(ids[0])  # twice: no-op
    loads = engine.dp_engine.loads
    assert loads[owner].kv_cache_usage == 0 and not loads[owner].has_unfinished and loads[1 - owner].num_running == 1
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert {o.request_id for o in outputs} == {ids[1]}
    refs = offline.generate(PROMPTS[:2], GREEDY)
    assert outputs[-1].outputs[0].token_ids == refs[1].outputs[0].token_ids
    assert dp_llm.generate(PROMPTS[:2], GREEDY)[0].outputs[0].token_ids == refs[0].outputs[0].token_ids


def _events(response: httpx.Response) -> list[dict]:
    lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _post(client: httpx.Client, path: str, body: dict) -> dict:
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


COMPLETIONS = [{"model": MODEL_NAME, "prompt": p, "max_tokens": 16, "temperature": 0, "logprobs": 2}
               for p in ["hello world", "the lazy dog", [0, 10, 7, 14, 14, 17], "Name a color!"]]
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Name a color!"}], "max_tokens": 16,
        "temperature": 0}


def _same_completion(got: dict, expected: dict) -> None:
    for a, b in zip(got["choices"], expected["choices"], strict=True):
        assert a["text"] == b["text"] and a["finish_reason"] == b["finish_reason"]
        assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
        assert a["logprobs"]["token_logprobs"] == pytest.approx(b["logprobs"]["token_logprobs"], abs=1e-4)
    assert got["usage"] == expected["usage"]


def test_concurrent_completions_equal_the_one_process_servers(dp_llm, dp_http, http):
    rank_steps(dp_llm)
    with ThreadPoolExecutor(len(COMPLETIONS)) as pool:
        got = list(pool.map(lambda body: _post(dp_http, "/v1/completions", body), COMPLETIONS))
    for body, out in zip(COMPLETIONS, got):
        _same_completion(out, _post(http, "/v1/completions", body))
    rank0, rank1 = rank_steps(dp_llm)
    assert len(rank0) == len(rank1) and sum(t for t, _ in rank0) > 0 and sum(t for t, _ in rank1) > 0


def test_streaming_completion_and_chat_equal_the_one_process_servers(dp_http, http):
    body = {**COMPLETIONS[1], "stream": True, "stream_options": {"include_usage": True}}
    expected = _post(http, "/v1/completions", COMPLETIONS[1])
    with dp_http.stream("POST", "/v1/completions", json=body) as response:
        events = _events(response)
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == expected["choices"][0]["text"]
    assert len([e for e in events if e["choices"]]) > 2 and events[-1]["usage"] == expected["usage"]

    expected = _post(http, "/v1/chat/completions", CHAT)
    assert _post(dp_http, "/v1/chat/completions", CHAT)["choices"] == expected["choices"]
    with dp_http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as response:
        events = _events(response)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert text == expected["choices"][0]["message"]["content"]
    assert events[-1]["choices"][0]["finish_reason"] == expected["choices"][0]["finish_reason"]


def _aborts(client: httpx.Client) -> int:
    line = next(l for l in client.get("/metrics").text.splitlines() if 'finished_reason="abort"' in l)
    return int(float(line.split()[-1]))


def test_disconnect_aborts_on_the_owning_rank(dp_llm, dp_server, dp_http):
    dp_server.wait_idle()
    aborts = _aborts(dp_http)
    body = {**COMPLETIONS[0], "max_tokens": 200, "ignore_eos": True, "stream": True}
    with dp_http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        loads = dp_llm.dp_engine.loads
        assert sorted(load.num_running for load in loads) == [0, 1]  # on one rank, holding blocks there
        assert max(load.kv_cache_usage for load in loads) > 0
    dp_server.wait_idle()
    deadline = time.monotonic() + 10
    while _aborts(dp_http) != aborts + 1:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.02)
    assert all(not load.has_unfinished and load.kv_cache_usage == 0 for load in dp_llm.dp_engine.loads)


def test_bad_requests_get_400_while_another_completes(dp_llm, dp_http, http):
    long = {**COMPLETIONS[2], "max_tokens": 120, "ignore_eos": True}
    expected = _post(http, "/v1/completions", long)
    result = []
    thread = threading.Thread(target=lambda: result.append(_post(dp_http, "/v1/completions", long)))
    thread.start()
    deadline = time.monotonic() + 30
    while not any(load.num_running for load in dp_llm.dp_engine.loads):
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.005)
    bad = [{**COMPLETIONS[0], "prompt": [1, 2, 999]}, {**COMPLETIONS[0], "prompt": "x" * 300},
           {**COMPLETIONS[0], "prompt": [1, 2, 999], "stream": True}, {**CHAT, "max_tokens": 500}]
    for body in bad:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        response = dp_http.post(path, json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["message"]
    thread.join(60)
    _same_completion(result[0], expected)
    assert dp_http.get("/health").status_code == 200


def test_a_rank_dead_while_idle_turns_health_and_requests_to_503(dp_llm, dp_http):
    """Last test of the module's ranks: it ends them. No request runs, yet the death is seen within seconds (a rank
    killed under load: test_dead_rank.py)."""
    pids = dp_llm.dp_engine.workers.pids
    os.kill(pids[1], signal.SIGKILL)
    deadline = time.monotonic() + 2 + 2 * HEALTH_CHECK_S + GRACE_S
    while dp_http.get("/health").status_code == 200:
        assert time.monotonic() < deadline, "the dead rank went unnoticed"
        time.sleep(0.05)
    response = dp_http.post("/v1/completions", json=COMPLETIONS[0])
    assert response.status_code == 503 and "rank 1 died" in response.json()["error"]["message"]
    for pid in pids:
        assert process_gone(pid)
    with pytest.raises(WorkerFailure, match="already stopped"):
        dp_llm.generate(PROMPTS[:1], GREEDY)
