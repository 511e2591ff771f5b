"""`/health` latency while the server tokenizes a maximum-size prompt (issue 14: tokenization off the event loop).

Starts `latentserve serve` on the embedded model, measures /health over a keep-alive connection while idle, then
while a ~3.9 MB text prompt (just under the default --max-request-bytes) is tokenized and refused as too long.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time

import httpx


def _latencies(client: httpx.Client, url: str, until: threading.Event | None, count: int = 30) -> list[float]:
    out: list[float] = []
    while (until is None and len(out) < count) or (until is not None and not until.is_set()):
        start = time.perf_counter()
        client.get(f"{url}/health", timeout=10)
        out.append(time.perf_counter() - start)
        time.sleep(0.02)
    return out


def _summary(xs: list[float]) -> str:
    return f"median {statistics.median(xs) * 1e3:.1f} ms, max {max(xs) * 1e3:.1f} ms over {len(xs)} probes"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--prompt-bytes", type=int, default=3_900_000)
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen([sys.executable, "-m", "latentserve.cli", "serve", "--port", str(args.port),
                               "--num-threads", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with httpx.Client() as client:
            for _ in range(600):
                try:
                    if client.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            model = client.get(f"{url}/v1/models").json()["data"][0]["id"]
            idle = _latencies(client, url, None)
            text = "And God said unto Moses " * (args.prompt_bytes // 24)
            done = threading.Event()

            def big() -> None:
                reply = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": text, "max_tokens": 1},
                                   timeout=120)
                print(f"big request: HTTP {reply.status_code}")
                done.set()

            threading.Thread(target=big).start()
            busy = _latencies(client, url, done)
        print(f"/health idle: {_summary(idle)}")
        print(f"/health during the big request: {_summary(busy)}")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
