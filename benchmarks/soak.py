"""Soak test of `latentserve serve`: concurrent clients over loopback for a bounded time, checking every answer.

Starts the server in a subprocess on 127.0.0.1 (the embedded model unless `--model`), then `--clients` clients send,
for `--seconds`, a random mix of: completions and chat, streamed and not, n=2, logprobs, stop strings, json_schema
and json_object outputs (some with the control-character tokens pushed up by logit_bias), tool calls (required and
named), and clients that disconnect mid-stream or mid-request. Every structured output and tool call must parse with
a strict JSON parser and validate against its schema; every stream must end with [DONE] and no error event; logprobs
must list the returned text's tokens. Afterwards the engine must be idle, /health 200, the server log free of
tracebacks, and SIGTERM must end the server with status 0. Exits 1 on any failure, printing each.
Run: `.venv/bin/python benchmarks/soak.py [--seconds 60] [--clients 8] [--model PATH]`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import jsonschema

ROOT = Path(__file__).resolve().parent.parent
SERVE = """
import sys, torch
torch.set_num_threads(int(sys.argv[3]))
from latentserve.engine.engine_config import EngineConfig
from latentserve.server import ServerConfig, run_server
sys.exit(run_server(sys.argv[1] or None, EngineConfig(max_num_seqs=32), ServerConfig(port=int(sys.argv[2]),
         served_model_name="soak", drain_timeout=10, log_level="info")))
"""
MODEL = "soak"
PROMPTS = ["And God said", "In the beginning", "The LORD is my shepherd", "And it came to pass", "Who begat whom?"]
CONTROL = {str(i): 30 for i in range(193, 225)}  # the embedded tokenizer's tokens of bytes 0x00-0x1f
NAME = {"type": "string", "maxLength": 12}
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME}, "required": ["name"]},
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"tribe": {"enum": ["Judah", "Levi", "Dan"]}, "tags": {
        "type": "array", "items": NAME, "maxItems": 2}}, "required": ["tribe", "tags"]},
    {"type": "object", "propertyNames": {"maxLength": 6}, "additionalProperties": {"type": "boolean"},
     "minProperties": 1, "maxProperties": 2},
]
TOOL = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}, "verse": {"type": "integer", "minimum": 1,
                                                                           "maximum": 99}},
    "required": ["text", "verse"]}}}


class Failure(Exception):
    pass


def check(condition: bool, what: str) -> None:
    if not condition:
        raise Failure(what)


def strict_json(text: str, schema: dict | None) -> object:
    check(not re.search(r"[\x00-\x1f]", text), f"raw control character in {text!r}")
    value = json.loads(text)  # strict: refuses control characters in strings
    if schema is not None:
        jsonschema.validate(value, schema)
    return value


async def events(response: httpx.Response) -> list[dict]:
    lines = [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]
    check(lines and lines[-1] == "[DONE]", f"stream did not end with [DONE]: {lines[-2:]}")
    chunks = [json.loads(line) for line in lines[:-1]]
    errors = [c for c in chunks if "error" in c]
    check(not errors, f"error event: {errors}")
    return chunks


def check_logprobs(text: str, tokens: list[str]) -> None:
    """The tokens listed are the text's: special tokens aside (not in the text), they spell it, the last one possibly
    running into a stripped stop string, but none lying wholly past the text."""
    tokens = [t for t in tokens if not re.fullmatch(r"<\|[^|]*\|>", t)]
    if not text.isascii() or not tokens:
        check(text == "" or not text.isascii(), f"no logprobs tokens for {text!r}")
        return
    joined = "".join(tokens)
    check(joined.startswith(text) and len(joined) - len(tokens[-1]) < max(len(text), 1),
          f"logprobs tokens {tokens!r} are not those of the text {text!r}")


async def completion(client: httpx.AsyncClient, rng: random.Random) -> str:
    stream, prompt = rng.random() < 0.5, rng.choice(PROMPTS)
    stop = rng.choice([None, ["\n"], [" the"], ["said"]])
    body = {"model": MODEL, "prompt": prompt, "max_tokens": rng.randint(4, 40), "temperature": rng.choice([0, 0.8]),
            "n": rng.choice([1, 2]), "logprobs": rng.choice([None, 2]), "stop": stop, "stream": stream}
    if stream:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            check(response.status_code == 200, f"status {response.status_code}")
            texts: dict[int, str] = {}
            tokens: dict[int, list[str]] = {}
            for chunk in await events(response):
                for c in chunk["choices"]:
                    texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                    tokens.setdefault(c["index"], []).extend((c["logprobs"] or {}).get("tokens", []))
            choices = [{"text": texts[i], "tokens": tokens[i]} for i in sorted(texts)]
    else:
        response = await client.post("/v1/completions", json=body)
        check(response.status_code == 200, f"status {response.status_code}: {response.text[:200]}")
        choices = [{"text": c["text"], "tokens": (c["logprobs"] or {}).get("tokens", [])}
                   for c in response.json()["choices"]]
    check(len(choices) == body["n"], f"{len(choices)} choices for n={body['n']}")
    for c in choices:
        check(not stop or not any(s in c["text"] for s in stop), f"stop string in {c['text']!r}")
        if body["logprobs"]:
            check_logprobs(c["text"], c["tokens"])
    return f"completion{' stream' if stream else ''}"


async def chat(client: httpx.AsyncClient, rng: random.Random) -> str:
    kind = rng.choice(["text", "json_schema", "json_object", "tool required", "tool named"])
    body = {"model": MODEL, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
            "temperature": rng.choice([0, 1.0]), "max_tokens": 150, "stream": rng.random() < 0.5}
    schema = None
    if kind == "text":
        body.update(max_tokens=rng.randint(4, 40), n=rng.choice([1, 2]), logprobs=True, stop=["\n"])
    elif kind == "json_schema":
        schema = rng.choice(SCHEMAS)
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    elif kind == "json_object":
        body.update(response_format={"type": "json_object"}, max_tokens=60)
    else:
        body.update(tools=[TOOL], tool_choice="required" if kind == "tool required" else
                    {"type": "function", "function": {"name": "note"}}, max_tokens=250)
    if kind != "text" and rng.random() < 0.5:
        body["logit_bias"] = CONTROL
    choices = await _chat_choices(client, body)
    for c in choices:
        if kind == "text":
            check("\n" not in c["content"], f"stop string in {c['content']!r}")
            check_logprobs(c["content"], c["tokens"])
        elif kind.startswith("tool"):
            check(c["tool_calls"] and c["finish_reason"] in ("tool_calls", "stop"), f"no tool call: {c}")
            for call in c["tool_calls"]:
                strict_json(call["arguments"], TOOL["function"]["parameters"])
        elif kind == "json_object":
            check(not re.search(r"[\x00-\x1f]", c["content"]), f"raw control character in {c['content']!r}")
            if c["finish_reason"] == "stop":  # an object may be cut short by max_tokens
                check(isinstance(strict_json(c["content"], None), dict), "not an object")
        else:
            check(c["finish_reason"] == "stop", f"finish_reason {c['finish_reason']}: {c['content']!r}")
            strict_json(c["content"], schema)
    return f"chat {kind}{' stream' if body['stream'] else ''}"


async def _chat_choices(client: httpx.AsyncClient, body: dict) -> list[dict]:
    """Per choice: content, logprob tokens, tool calls (name, arguments), finish_reason; streams reassembled."""
    if not body["stream"]:
        response = await client.post("/v1/chat/completions", json=body)
        check(response.status_code == 200, f"status {response.status_code}: {response.text[:200]}")
        return [{"content": c["message"]["content"] or "", "finish_reason": c["finish_reason"],
                 "tokens": [t["token"] for t in (c["logprobs"] or {}).get("content") or []],
                 "tool_calls": [c2["function"] for c2 in c["message"].get("tool_calls") or []]}
                for c in response.json()["choices"]]
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        check(response.status_code == 200, f"status {response.status_code}")
        choices: dict[int, dict] = {}
        for chunk in await events(response):
            for c in chunk["choices"]:
                entry = choices.setdefault(c["index"], {"content": "", "tokens": [], "calls": {}, "finish_reason": None})
                entry["content"] += c["delta"].get("content") or ""
                entry["tokens"] += [t["token"] for t in (c.get("logprobs") or {}).get("content") or []]
                for call in c["delta"].get("tool_calls") or []:
                    slot = entry["calls"].setdefault(call["index"], {"name": "", "arguments": ""})
                    slot["name"] += call["function"].get("name") or ""
                    slot["arguments"] += call["function"].get("arguments") or ""
                entry["finish_reason"] = c["finish_reason"] or entry["finish_reason"]
    return [{**e, "tool_calls": [e["calls"][i] for i in sorted(e["calls"])]} for _, e in sorted(choices.items())]


async def disconnect(client: httpx.AsyncClient, rng: random.Random) -> str:
    body = {"model": MODEL, "prompt": rng.choice(PROMPTS), "max_tokens": 200, "ignore_eos": True}
    if rng.random() < 0.5:
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break  # leaving the block closes the connection mid-stream
        return "disconnect stream"
    try:
        await client.post("/v1/completions", json=body, timeout=rng.uniform(0.05, 0.5))
    except httpx.TimeoutException:
        pass
    return "disconnect"


async def client_loop(url: str, seed: int, deadline: float, counts: Counter, failures: list[str]) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        while time.monotonic() < deadline:
            kind = rng.choices([completion, chat, disconnect], weights=[4, 5, 1])[0]
            try:
                counts[await kind(client, rng)] += 1
            except Exception as e:  # noqa: BLE001 - every failure is reported, the soak goes on
                failures.append(f"{kind.__name__}: {type(e).__name__}: {e}"[:500])


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with status {process.returncode}")
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit("the server did not come up")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the server")
    parser.add_argument("--model", default="", help="checkpoint folder (default: the embedded model)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", prefix="soak-")
    process = subprocess.Popen([sys.executable, "-c", SERVE, args.model, str(port), str(args.threads)], cwd=ROOT,
                               stderr=log, stdout=subprocess.DEVNULL)
    counts: Counter = Counter()
    failures: list[str] = []
    try:
        wait_healthy(url, process)
        start = time.monotonic()
        deadline = start + args.seconds

        async def run() -> None:
            await asyncio.gather(*(client_loop(url, args.seed * 1000 + i, deadline, counts, failures)
                                   for i in range(args.clients)))

        asyncio.run(run())
        elapsed = time.monotonic() - start
        idle_by = time.monotonic() + 30
        while (running := _gauge(url, "num_requests_running") + _gauge(url, "num_requests_waiting")) > 0:
            if time.monotonic() > idle_by:
                failures.append(f"the engine still holds {running} request(s) after the soak")
                break
            time.sleep(0.2)
        if httpx.get(f"{url}/health").status_code != 200:
            failures.append("/health is not 200 after the soak")
        process.send_signal(signal.SIGTERM)
        if process.wait(60) != 0:
            failures.append(f"SIGTERM: the server exited with status {process.returncode}")
    finally:
        if process.poll() is None:
            process.kill()
    log.seek(0)
    text = log.read()
    for marker in ("Traceback", "never retrieved", "ERROR"):
        if marker in text:
            failures.append(f"server log has {marker!r}: ...{text[max(text.index(marker) - 300, 0):][:1500]}")
    print(f"{sum(counts.values())} requests from {args.clients} clients in {elapsed:.0f} s, {len(failures)} failures")
    for kind, n in sorted(counts.items()):
        print(f"  {kind}: {n}")
    for failure in failures:
        print(f"FAIL {failure}")
    return 1 if failures else 0


def _gauge(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"latentserve:{name}")]
    return sum(values)


if __name__ == "__main__":
    sys.exit(main())
