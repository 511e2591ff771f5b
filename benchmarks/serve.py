"""Serving benchmark: request throughput, TTFT and inter-token latency at several client concurrencies.

Starts `latentserve` in a subprocess on 127.0.0.1 (the embedded model unless `--model`), then at each
concurrency level runs a bounded number of streaming /v1/completions requests (random token-id prompts,
fixed output length with ignore_eos) and prints a markdown table. Percentiles are over requests (TTFT)
and over all gaps between streamed chunks (ITL). With `--baseline DIR` (another checkout, e.g. from
`git archive`), a second server runs that code side by side: each level runs on both, alternating, and a
last table gives this tree's throughput over the baseline's. With `--structured`, each level also runs the same
requests constrained to a JSON schema, one schema shared by all and one new schema per request (compiled while the
others run), on the same server, in `--rounds` rounds of the three back to back (the machine's load drifts between
rounds, not within one); the last table gives the median over rounds of each round's constrained / unconstrained.
Run: `.venv/bin/python benchmarks/serve.py [--model PATH] [--quick] [--baseline DIR] [--structured]`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
SERVE = """
import sys, torch
torch.set_num_threads(int(sys.argv[3]))
from latentserve.engine.engine_config import EngineConfig
from latentserve.server import ServerConfig, run_server
model = sys.argv[1] or None
run_server(model, EngineConfig(max_num_seqs=64), ServerConfig(port=int(sys.argv[2]), served_model_name="bench",
           log_level="warning"))
"""


@dataclass
class RequestResult:
    ttft: float
    itls: list[float] = field(default_factory=list)
    num_tokens: int = 0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q / 100 * len(ordered)), len(ordered) - 1)]


# An array of at least 64 digits (two tokens each): a constrained request cannot end before max_tokens either.
DIGITS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 64}
STRUCTURED = {
    "unconstrained": lambda i: {},
    "json schema": lambda i: {"structured_outputs": {"json": DIGITS}},
    "new schema each": lambda i: {"structured_outputs": {"json": {**DIGITS, "maxItems": 100_000 + i}}},
}


async def one_request(client: httpx.AsyncClient, prompt: list[int], max_tokens: int,
                      extra: dict | None = None) -> RequestResult:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    start = time.perf_counter()
    times, usage = [], None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                times.append(time.perf_counter())
            usage = chunk.get("usage") or usage
    return RequestResult(ttft=times[0] - start, itls=[b - a for a, b in zip(times, times[1:])],
                         num_tokens=usage["completion_tokens"])


async def run_level(url: str, concurrency: int, num_requests: int, prompts: list[list[int]], max_tokens: int,
                    extra=lambda i: {}) -> dict:
    queue = list(range(num_requests))
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def worker() -> None:
            while queue:
                i = queue.pop()
                results.append(await one_request(client, prompts[i % len(prompts)], max_tokens, extra(i)))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    ttfts = [r.ttft * 1e3 for r in results]
    itls = [x * 1e3 for r in results for x in r.itls]
    row = {"concurrency": concurrency, "requests": len(results), "req/s": len(results) / elapsed,
           "tok/s": sum(r.num_tokens for r in results) / elapsed}
    for name, values in (("TTFT", ttfts), ("ITL", itls)):
        for q in (50, 90, 99):
            row[f"{name} p{q} (ms)"] = percentile(values, q) if values else float("nan")
    row["ITL mean (ms)"] = statistics.fmean(itls) if itls else float("nan")
    return row


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model: str | None, port: int, threads: int, root: Path = ROOT) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(root)}
    process = subprocess.Popen([sys.executable, "-c", SERVE, model or "", str(port), str(threads)], cwd=root, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with status {process.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return process
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise SystemExit("the server did not come up within 120 s")


def vocab_size(model: str | None) -> int:
    if model is None:
        from latentserve.assets import DEFAULT_MODEL_DIR

        model = DEFAULT_MODEL_DIR
    return json.loads((Path(model) / "config.json").read_text())["vocab_size"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--requests", type=int, default=64, help="requests per level at most (at least 2x concurrency)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    parser.add_argument("--quick", action="store_true", help="fewer, shorter requests")
    parser.add_argument("--baseline", default=None, help="another latentserve checkout to run side by side")
    parser.add_argument("--structured", action="store_true", help="also constrained to JSON schemas, against unconstrained")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the --structured comparison")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.max_tokens = 16, 16
    sys.path.insert(0, str(ROOT))
    rng = random.Random(0)
    vocab = vocab_size(args.model)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(64)]
    if args.structured:
        structured_run(args, prompts)
        return
    roots = {"latentserve": ROOT} | ({"baseline": Path(args.baseline).resolve()} if args.baseline else {})
    processes, urls = {}, {}
    try:
        for name, root in roots.items():
            port = free_port()
            processes[name] = start_server(args.model, port, args.threads, root)
            urls[name] = f"http://127.0.0.1:{port}"
        for url in urls.values():
            asyncio.run(run_level(url, 1, 2, prompts, 4))  # warm-up
        rows: dict[str, list[dict]] = {name: [] for name in roots}
        for c in args.concurrency:
            for name in reversed(roots):  # the baseline first at each level, then this tree
                rows[name].append(asyncio.run(run_level(urls[name], c, max(args.requests, 2 * c), prompts,
                                                        args.max_tokens)))
    finally:
        for process in processes.values():
            process.terminate()
            process.wait(60)
    print(f"\nprompt {args.prompt_len} tokens, {args.max_tokens} output tokens per request, "
          f"server torch threads {args.threads}, model {args.model or 'embedded'}")
    for name in roots:
        print(f"\n{name} ({roots[name]})\n")
        print_table(rows[name])
    if args.baseline:
        print("\nthis tree / baseline\n")
        print_table([{"concurrency": new["concurrency"], "tok/s ratio": new["tok/s"] / old["tok/s"],
                      "TTFT p50 ratio": new["TTFT p50 (ms)"] / old["TTFT p50 (ms)"],
                      "ITL mean ratio": new["ITL mean (ms)"] / old["ITL mean (ms)"]}
                     for new, old in zip(rows["latentserve"], rows["baseline"])], digits=2)


def structured_run(args: argparse.Namespace, prompts: list[list[int]]) -> None:
    port = free_port()
    process = start_server(args.model, port, args.threads)
    url = f"http://127.0.0.1:{port}"
    rows: dict[str, list[dict]] = {name: [] for name in STRUCTURED}
    try:
        for extra in STRUCTURED.values():  # warm-up
            asyncio.run(run_level(url, 8, 16, prompts, 8, extra))
        for c in args.concurrency:
            for _ in range(args.rounds):
                for name, extra in STRUCTURED.items():
                    rows[name].append(asyncio.run(run_level(url, c, max(args.requests, 2 * c), prompts,
                                                            args.max_tokens, extra)))
    finally:
        process.terminate()
        process.wait(60)
    print(f"\nprompt {args.prompt_len} tokens, {args.max_tokens} output tokens per request, "
          f"server torch threads {args.threads}, model {args.model or 'embedded'}")
    for name in STRUCTURED:
        print(f"\n{name}\n")
        print_table(rows[name])
    print(f"\nconstrained / unconstrained, median of {args.rounds} rounds\n")
    table = []
    for i, c in enumerate(args.concurrency):
        rounds = slice(i * args.rounds, (i + 1) * args.rounds)
        for name in list(STRUCTURED)[1:]:
            pairs = list(zip(rows["unconstrained"][rounds], rows[name][rounds]))
            table.append({"concurrency": c, "mode": name} | {
                f"{key} ratio": statistics.median(row[key] / base[key] for base, row in pairs)
                for key in ("tok/s", "TTFT p50 (ms)", "TTFT p99 (ms)")})
    print_table(table, digits=2)


def print_table(rows: list[dict], digits: int = 1) -> None:
    print("| " + " | ".join(rows[0]) + " |")
    print("|" + "---|" * len(rows[0]))
    for row in rows:
        print("| " + " | ".join(f"{v:.{digits}f}" if isinstance(v, float) else str(v) for v in row.values()) + " |")


if __name__ == "__main__":
    main()
