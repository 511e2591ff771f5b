"""vLLM's documented DeepSeek serving lines start `latentserve serve` (with `vllm` replaced and a local model), every
vLLM flag accepted has its effect, and the others are refused by name with the reason."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from latentserve.assets import DEFAULT_MODEL_DIR
from latentserve.cli import main, make_parser, vllm_flags
from latentserve.cli import serve as serve_cli
from latentserve.engine.chat_template import render_chat
from latentserve.engine.vllm_options import OPTIONS
from tests.engine.test_chat_template import THINKING

REPO = Path(__file__).resolve().parents[2]
# Small pools for the tests: the flags themselves (--kv-cache-memory-bytes is one under test).
SMALL = "--max-model-len 256 --kv-cache-memory-bytes 16M --num-threads 1"
TOOLS = [{"type": "function", "function": {"name": "get_verse", "parameters": {
    "type": "object", "properties": {"book": {"type": "string"}}, "required": ["book"]}}}]
# A template unlike the tokenizer's: a prompt rendered with it proves --chat-template was used.
TEMPLATE = "{% for m in messages %}<｜User｜>{{ m['content'] }}{% endfor %}<｜Assistant｜>"


def start(argv: list[str], monkeypatch) -> tuple[TestClient, serve_cli.ServerConfig]:
    """`latentserve serve ARGV` up to the point where uvicorn would run: the app it built, and its settings."""
    built = {}
    monkeypatch.setattr(serve_cli, "serve_app", lambda app, config: built.update(app=app, config=config) or 0)
    assert main(["serve", *argv]) == 0
    return TestClient(built["app"]), built["config"]


def vllm_line(line: str, model: Path, **files: Path) -> list[str]:
    """A vLLM command line's arguments after `vllm serve MODEL`, with local paths put in."""
    args = shlex.split(line.format(**files))
    assert args[:2] == ["vllm", "serve"]
    return [str(model), *args[3:], *shlex.split(SMALL)]


def chat(client: TestClient, model: str, **body) -> dict:
    response = client.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": "And God said"}], "max_tokens": 4,
        "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_vllm_tool_calling_line(tmp_path, monkeypatch):
    template = tmp_path / "tool_chat_template_deepseekv3.jinja"
    template.write_text(TEMPLATE)
    argv = vllm_line("vllm serve deepseek-ai/DeepSeek-V3-0324 --tensor-parallel-size 1 --enable-auto-tool-choice "
                     "--tool-call-parser deepseek_v3 --chat-template {template}", DEFAULT_MODEL_DIR, template=template)
    client, config = start(argv, monkeypatch)
    with client:
        name = DEFAULT_MODEL_DIR.name
        assert chat(client, name, tools=TOOLS, tool_choice="auto")["choices"][0]["finish_reason"] in ("length", "stop",
                                                                                                    "tool_calls")
        messages = [{"role": "user", "content": "hi"}]
        tokens = client.post("/tokenize", json={"model": name, "messages": messages}).json()["tokens"]
        tokenizer = client.app.state.engine.engine.tokenizer
        assert tokenizer.chat_template != TEMPLATE  # the model's own is another
        expected = tokenizer.encode("<｜User｜>hi<｜Assistant｜>", add_special_tokens=False)
        assert tokens == expected
        assert render_chat(tokenizer, messages) != "<｜User｜>hi<｜Assistant｜>"


def test_vllm_reasoning_line(monkeypatch):
    argv = vllm_line("vllm serve deepseek-ai/DeepSeek-R1 --tensor-parallel-size 1 --reasoning-parser deepseek_r1",
                     DEFAULT_MODEL_DIR)
    client, _ = start(argv, monkeypatch)
    with client:
        assert client.app.state.engine.engine.reasoning_parser is not None
        message = chat(client, DEFAULT_MODEL_DIR.name)["choices"][0]["message"]
        assert "reasoning_content" in message


def test_vllm_thinking_line(tmp_path, monkeypatch):
    """DeepSeek-V3.1's line with thinking on by default: the prompt opens the reasoning; a request turns it off."""
    template = tmp_path / "thinking.jinja"
    template.write_text(THINKING)
    argv = vllm_line("vllm serve deepseek-ai/DeepSeek-V3.1 --reasoning-parser deepseek_v3 --chat-template {template} "
                     "--default-chat-template-kwargs '{{\"thinking\": true}}'", DEFAULT_MODEL_DIR, template=template)
    client, config = start(argv, monkeypatch)
    assert config.default_chat_template_kwargs == {"thinking": True}
    with client:
        name, tokenizer = DEFAULT_MODEL_DIR.name, client.app.state.engine.engine.tokenizer.tokenizer
        messages = [{"role": "user", "content": "hi"}]
        tokens = client.post("/tokenize", json={"model": name, "messages": messages}).json()["tokens"]
        assert tokens[-1] == tokenizer.token_to_id("<think>")
        off = chat(client, name, chat_template_kwargs={"thinking": False})["choices"][0]["message"]
        assert off["reasoning_content"] is None and off["content"]


def test_vllm_deepseek_v32_line(monkeypatch):
    """DeepSeek-V3.2's line: its chat encoding built in (the checkpoint has no template), thinking switched per
    request."""
    argv = vllm_line("vllm serve deepseek-ai/DeepSeek-V3.2 --tensor-parallel-size 1 --tokenizer-mode deepseek_v32 "
                     "--tool-call-parser deepseek_v32 --enable-auto-tool-choice --reasoning-parser deepseek_v3",
                     DEFAULT_MODEL_DIR)
    client, _ = start(argv, monkeypatch)
    with client:
        name, tokenizer = DEFAULT_MODEL_DIR.name, engine_of(client).tokenizer
        messages = [{"role": "user", "content": "hi"}]
        tokens = client.post("/tokenize", json={"model": name, "messages": messages}).json()["tokens"]
        assert tokens == tokenizer.encode("<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜></think>",
                                          add_special_tokens=False)
        chat(client, name, chat_template_kwargs={"thinking": True})


def test_tokenizer_mode_values(model_dir, capsys):
    """vLLM's other modes are refused naming the ones there are."""
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", str(model_dir), "--tokenizer-mode", "slow"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--tokenizer-mode: invalid choice: 'slow'" in err and "auto" in err and "deepseek_v32" in err
    assert make_parser().parse_args(["serve", "--tokenizer-mode", "deepseek_v32"]).tokenizer_mode == "deepseek_v32"
    assert make_parser().parse_args(["chat"]).tokenizer_mode == "auto"


def test_vllm_mtp_line(monkeypatch):
    argv = vllm_line("vllm serve deepseek-ai/DeepSeek-V3 --tensor-parallel-size 1 --speculative-config "
                     "'{{\"method\": \"mtp\", \"num_speculative_tokens\": 1}}'", DEFAULT_MODEL_DIR)
    client, _ = start(argv, monkeypatch)
    with client:
        engine = client.app.state.engine.engine
        assert engine.spec_decoding_stats is not None
        assert engine.drafting_policy is not None
        chat(client, DEFAULT_MODEL_DIR.name)


def test_vllm_ngram_line(monkeypatch):
    argv = vllm_line("vllm serve deepseek-ai/DeepSeek-V2-Lite-Chat --speculative-config '{{\"method\": \"ngram\", "
                     "\"num_speculative_tokens\": 3, \"prompt_lookup_max\": 4}}'", DEFAULT_MODEL_DIR)
    client, _ = start(argv, monkeypatch)
    with client:
        engine = client.app.state.engine.engine
        proposer = engine.runner.spec_decoder.proposer
        assert (type(proposer).__name__, proposer.k, proposer.min_n, proposer.max_n) == ("NgramProposer", 3, 4, 4)
        chat(client, DEFAULT_MODEL_DIR.name)


def test_vllm_recipe_line(monkeypatch, capsys):
    argv = vllm_line("vllm serve deepseek-ai/DeepSeek-V3 --trust-remote-code --tensor-parallel-size 1 "
                     "--enable-prefix-caching --enable-chunked-prefill --kv-cache-dtype auto "
                     "--served-model-name ds3 --max-num-seqs 4", DEFAULT_MODEL_DIR)
    client, _ = start(argv, monkeypatch)
    assert "note: --trust-remote-code: latentserve runs its own model code and never executes" in \
        capsys.readouterr().err
    with client:
        chat(client, "ds3")


# --- each flag's effect -------------------------------------------------------------------------------------------

def engine_of(client: TestClient):
    return client.app.state.engine.engine


def test_engine_flags_reach_the_engine(model_dir, monkeypatch):
    base = [str(model_dir), "--dtype", "float32", "--num-threads", "1"]
    client, _ = start([*base, "--kv-cache-memory-bytes", "1M", "--kv-cache-dtype", "bfloat16",
                       "--no-enable-prefix-caching", "--no-enable-chunked-prefill"], monkeypatch)
    engine = engine_of(client)
    caches = list(engine.runner.kv_caches.values())
    assert {cache.dtype for cache in caches} == {torch.bfloat16}  # the model computes in float32
    cache_bytes = sum(cache.numel() * cache.itemsize for cache in caches)
    assert 1 << 19 < cache_bytes <= 1 << 20
    assert not engine.scheduler.block_manager.enable_prefix_caching
    assert not engine.scheduler.config.enable_chunked_prefill
    client, _ = start(base + ["--num-kv-blocks", "64"], monkeypatch)
    engine = engine_of(client)
    assert engine.scheduler.block_manager.enable_prefix_caching and engine.scheduler.config.enable_chunked_prefill


def test_tokenizer_flag(model_dir, tmp_path, monkeypatch):
    other = tmp_path / "tokenizer"
    other.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL_DIR / name, other / name)
    client, _ = start([str(model_dir), "--dtype", "float32", "--num-kv-blocks", "64", "--tokenizer", str(other)],
                      monkeypatch)
    assert engine_of(client).tokenizer.tokenizer.get_vocab_size() > 96  # not the model's character tokenizer
    code = main(["serve", str(model_dir), "--tokenizer", str(tmp_path / "none"), "--num-kv-blocks", "64"])
    assert code == 1


def test_max_logprobs(model_dir, monkeypatch):
    client, _ = start([str(model_dir), "--dtype", "float32", "--num-kv-blocks", "64", "--max-logprobs", "40"],
                      monkeypatch)
    body = {"model": model_dir.name, "prompt": "hello", "max_tokens": 1, "logprobs": 30}
    with client:
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200 and len(response.json()["choices"][0]["logprobs"]["top_logprobs"][0]) >= 30
        response = client.post("/v1/completions", json={**body, "logprobs": 41})
        assert response.status_code == 400 and response.json()["error"]["param"] == "logprobs"
        assert "max_logprobs=40" in response.json()["error"]["message"]


@pytest.mark.parametrize("setting, expected_tokens", [("folder", 3), ("vllm", 16)])
def test_generation_config(model_dir, tmp_path, monkeypatch, setting, expected_tokens):
    folder = tmp_path / "generation"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3, "temperature": 0.0}))
    value = str(folder) if setting == "folder" else setting
    client, _ = start([str(model_dir), "--dtype", "float32", "--num-kv-blocks", "64", "--generation-config", value],
                      monkeypatch)
    body = {"model": model_dir.name, "prompt": "hello", "ignore_eos": True}
    with client:
        first = client.post("/v1/completions", json=body).json()
        assert first["usage"]["completion_tokens"] == expected_tokens
        if setting == "folder":  # temperature 0 by default: the same text twice; a request's own value wins
            assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == first["choices"][0]["text"]
            explicit = client.post("/v1/completions", json={**body, "max_tokens": 5}).json()
            assert explicit["usage"]["completion_tokens"] == 5


def test_allowed_origins(model_dir, monkeypatch):
    base = [str(model_dir), "--dtype", "float32", "--num-kv-blocks", "64", "--api-key", "k"]
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    client, _ = start([*base, "--allowed-origins", '["https://app.example"]'], monkeypatch)
    with client:
        response = client.options("/v1/completions", headers=preflight)
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == "https://app.example"
        other = client.options("/v1/completions", headers={**preflight, "Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers
    client, _ = start(base, monkeypatch)
    with client:
        assert "access-control-allow-origin" not in client.options("/v1/completions", headers=preflight).headers


REFUSALS = {
    "--tensor-parallel-size 2": "--tensor-parallel-size 2: latentserve does not split layers over devices",
    "-tp 4": "-tp 4: latentserve does not split layers over devices",
    "--gpu-memory-utilization 0.9": "--gpu-memory-utilization 0.9: the KV cache is not sized as a share of GPU memory: "
                                    "give its size with --kv-cache-memory-bytes",
    "--kv-cache-dtype fp8_e5m2": "kv_cache_dtype 'fp8_e5m2' is not supported; the fp8 cache is e4m3",
    "--swap-space 4": "--swap-space 4: preempted requests are recomputed",
    "--allowed-origins '*'": "expected a list",
    "--kv-cache-memory-bytes lots": "expected a size in bytes",
}


def test_load_format_is_checked_against_the_model(model_dir, tmp_path, monkeypatch, capsys):
    """vLLM's --load-format: safetensors for a checkpoint folder, gguf for a GGUF file, auto either; the other
    pairings are refused (before any load) naming what --model is."""
    start([str(model_dir), "--load-format", "safetensors", *shlex.split(SMALL)], monkeypatch)[0].close()
    assert main(["serve", str(model_dir), "--load-format", "gguf"]) == 1
    assert "--load-format gguf: --model is a checkpoint folder" in capsys.readouterr().err
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")  # refused on its name and kind before anything reads it
    assert main(["serve", str(gguf), "--load-format", "safetensors"]) == 1
    assert "--load-format safetensors: --model is a GGUF file; give --load-format gguf" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", str(model_dir), "--load-format", "pt"])
    assert "invalid choice: 'pt'" in capsys.readouterr().err


@pytest.mark.parametrize("flags", REFUSALS)
def test_flags_without_counterpart_are_refused_by_name(model_dir, flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", str(model_dir), *shlex.split(flags)])
    assert exit_info.value.code == 2
    assert REFUSALS[flags] in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    ("--enable-auto-tool-choice", "--enable-auto-tool-choice needs --tool-call-parser"),
    ("--model {other}", "the model is given twice"),
    ("--chat-template no-such-template", "is neither a file nor a jinja2 template"),
    ("--chat-template '{{% for %}}'", "does not compile"),
    ("--default-chat-template-kwargs '{{\"enable_thinking\": true}}'", "reads no variable 'enable_thinking'"),
    ("--tokenizer-mode deepseek_v32 --chat-template '{{{{ messages }}}}'", "give one of the two"),
    ("--ssl-keyfile key.pem", "HTTPS needs both ssl_keyfile and ssl_certfile"),
    ("--num-kv-blocks 64 --kv-cache-memory-bytes 1G", "give one"),
    ("--generation-config {other}", "no generation_config.json there"),
])
def test_inconsistent_flags_are_refused(model_dir, tmp_path, flags, message, capsys):
    assert main(["serve", str(model_dir), *shlex.split(flags.format(other=tmp_path))]) == 1
    assert message in capsys.readouterr().err


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a certificate")
def test_real_start_with_https_cors_and_log_level(model_dir, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=127.0.0.1"], check=True, capture_output=True)
    port = free_port()
    argv = [sys.executable, "-m", "latentserve.cli", "serve", str(model_dir), "--port", str(port), "--dtype",
            "float32", "--num-kv-blocks", "64", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
            "--uvicorn-log-level", "warning", "--allowed-origins", '["https://app.example"]']
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        with httpx.Client(base_url=f"https://127.0.0.1:{port}", verify=False, timeout=5) as client:
            while True:
                assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.2)
            headers = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
            assert client.options("/v1/models", headers=headers).headers["access-control-allow-origin"] == \
                "https://app.example"
        with pytest.raises(httpx.TransportError):  # HTTPS only
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert "Uvicorn running on" not in err and "Application startup complete" not in err  # info lines: off


@pytest.mark.parametrize("flag", OPTIONS, ids=lambda flag: flag.names[0])
def test_every_vllm_flag_without_counterpart_says_why(flag, capsys):
    """Refused ones exit 2 naming the flag and the reason; accepted values and no-op flags parse (no-ops with a note)."""
    argv = ["serve", flag.names[0]] + (["0.5" if not flag.accepted else "8"] if flag.takes_value else [])
    if flag.note:
        args = make_parser().parse_args(argv)
        vllm_flags.print_notes(args)
        assert capsys.readouterr().err == f"latentserve: note: {flag.names[0]}: {flag.reason}\n"
        return
    with pytest.raises(SystemExit) as exit_info:
        make_parser().parse_args(argv)
    assert exit_info.value.code == 2
    given = " ".join(argv[1:])
    assert f"{given}: {flag.reason}" in capsys.readouterr().err
    for value in flag.accepted if flag.takes_value else ():
        assert vllm_flags.NOTES_DEST in vars(make_parser().parse_args(["serve", flag.names[0], str(value)]))
