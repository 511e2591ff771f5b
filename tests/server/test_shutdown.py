"""SIGTERM: the in-flight stream completes, new requests get 503, the drain is logged, and the process exits 0 in
bounded time."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx

from tests.server.conftest import ENGINE, MODEL_NAME, free_socket

SERVE = """
import sys, torch
torch.set_num_threads(1)
from latentserve.engine.engine_config import EngineConfig
from latentserve.server import ServerConfig, run_server
run_server(sys.argv[1], EngineConfig(**{engine}),
           ServerConfig(port=int(sys.argv[2]), served_model_name={name!r}, drain_timeout=30, log_level="info"))
"""


def _wait_healthy(url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert process.poll() is None, process.communicate()[1]
        assert time.monotonic() < deadline, "the server did not come up"
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)


def test_sigterm_drains_then_exits_zero(model_dir):
    sock = free_socket()
    port = sock.getsockname()[1]
    sock.close()
    url = f"http://127.0.0.1:{port}"
    code = SERVE.format(engine=ENGINE, name=MODEL_NAME)
    process = subprocess.Popen([sys.executable, "-c", code, str(model_dir), str(port)], stderr=subprocess.PIPE)
    try:
        _wait_healthy(url, process)
        body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 250, "ignore_eos": True, "stream": True}
        events: list[str] = []
        first = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(30)
        process.send_signal(signal.SIGTERM)
        probe = {**body, "stream": False, "max_tokens": 1}
        deadline = time.monotonic() + 5
        while (refused := httpx.post(f"{url}/v1/completions", json=probe, timeout=10)).status_code == 200:
            assert time.monotonic() < deadline, "requests are still accepted after SIGTERM"  # signal not handled yet
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable_error"
        assert reader.is_alive(), "the stream ended before the refusal was checked"
        reader.join(60)
        assert process.wait(30) == 0
        assert "signal 15: draining 1 in-flight request(s)" in process.stderr.read().decode()
    finally:
        if process.poll() is None:
            process.kill()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert len(text) > 0 and "error" not in events[-2]
