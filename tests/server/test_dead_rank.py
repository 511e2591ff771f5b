"""A data-parallel rank killed under load: the requests in flight get a 503 or an SSE error event
naming the dead rank, and the server process exits with status 1 within seconds, saying why, for a supervisor to
restart it (before, it lived on answering 503 to everything). A rank dead while idle: test_data_parallel.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from tests.distributed.helpers import process_gone
from tests.server.conftest import ENGINE, MODEL_NAME, free_socket
from tests.server.test_shutdown import _wait_healthy

SERVE = """
import sys, torch
torch.set_num_threads(1)
from latentserve.engine.engine_config import EngineConfig
from latentserve.server import ServerConfig, run_server
sys.exit(run_server(sys.argv[1], EngineConfig(**{engine}), ServerConfig(port=int(sys.argv[2]),
         served_model_name={name!r}, log_level="info")))
"""
DP = dict(ENGINE, data_parallel_size=2, enable_expert_parallel=True)
NUM_REQUESTS = 12
EXIT_S = 15  # the rank's death to the server's exit, at most


def rank_pids(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children if b"child_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def request(url: str, i: int, results: dict, started: threading.Event) -> None:
    body = {"model": MODEL_NAME, "prompt": f"request {i}", "max_tokens": 230, "ignore_eos": True,
            "stream": i % 2 == 0}
    try:
        if not body["stream"]:
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            results[i] = (response.status_code, response.json())
            return
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            events = []
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()
            results[i] = (response.status_code, events)
    except httpx.TransportError as e:
        results[i] = (None, repr(e))


def check_answer(status: int | None, answer) -> bool:
    """Whether the request failed, naming the dead rank (else it completed before the death)."""
    assert status is not None, answer  # answered, not cut off
    if isinstance(answer, dict):  # not streamed
        if status == 200:
            assert answer["choices"][0]["finish_reason"] == "length", answer
            return False
        assert status == 503 and "died" in answer["error"]["message"], answer
        return True
    assert status == 200 and answer[-1] == "[DONE]", answer
    last = json.loads(answer[-2])
    if "error" in last:
        assert last["error"]["code"] == 503 and "died" in last["error"]["message"], last
        return True
    assert last["choices"][0]["finish_reason"] == "length", last
    return False


def test_a_rank_killed_under_load_ends_the_server_with_status_1(model_dir, tmp_path):
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "stderr").open("w+")
    process = subprocess.Popen([sys.executable, "-c", SERVE.format(engine=DP, name=MODEL_NAME), str(model_dir),
                                str(port)], stderr=log)
    try:
        _wait_healthy(url, process)
        ranks = rank_pids(process.pid)
        assert len(ranks) == 2
        results: dict[int, tuple] = {}
        started = threading.Event()
        threads = [threading.Thread(target=request, args=(url, i, results, started)) for i in range(NUM_REQUESTS)]
        for thread in threads:
            thread.start()
        assert started.wait(30)
        os.kill(ranks[1], signal.SIGKILL)
        killed = time.monotonic()
        assert process.wait(EXIT_S) == 1
        assert time.monotonic() - killed < EXIT_S
        for thread in threads:
            thread.join(30)
            assert not thread.is_alive(), "a request was left hanging"
    finally:
        if process.poll() is None:
            process.kill()
    assert process_gone(ranks[0])
    failed = [check_answer(*results[i]) for i in range(NUM_REQUESTS)]
    assert any(failed)
    log.seek(0)
    text = log.read()
    assert "rank 1 died: its process was killed by signal 9" in text and "exiting with status 1" in text, text[-3000:]
