"""A tiny checkpoint with a character-level tokenizer and chat template, and live servers over it."""
from __future__ import annotations

import json
import socket
import string
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from tokenizers import Tokenizer, decoders, models

from latentserve.engine.llm import LLM
from latentserve.engine.engine_config import EngineConfig
from latentserve.engine.llm_engine import LLMEngine
from latentserve.server import build_app
from latentserve.server.api import DEFAULT_BODY_READ_TIMEOUT, DEFAULT_MAX_REQUEST_BYTES
from tests.checkpoints import make_checkpoint

MODEL_NAME = "tiny-v3"
API_KEY = "test-key"
SPECIAL = ["<s>", "</s>", "<unk>"]
CHARS = string.ascii_lowercase + string.ascii_uppercase + string.digits + " .,!?'\n:;|<>-_/()[]{}+=*&^%$#@~"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# The engine settings of every server here and of the offline reference.
ENGINE = dict(dtype="float32", num_kv_blocks=256, block_size=8, max_num_seqs=64)  # fp32: compared at round-off


def write_tokenizer(model_dir: Path) -> None:
    """A character-level tokenizer filling the checkpoint's vocab of 96, with BOS/EOS and a chat template."""
    vocab = {token: i for i, token in enumerate(SPECIAL + list(CHARS))}
    assert len(vocab) == 96
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(SPECIAL)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
              "chat_template": CHAT_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    path = make_checkpoint(tmp_path_factory.mktemp("server"), "v3")
    write_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def offline(model_dir) -> LLM:
    """The offline engine: the reference every served output must equal."""
    return LLM(model=model_dir, **ENGINE)


def free_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


class LiveServer:
    """uvicorn serving `build_app(...)` on a free 127.0.0.1 port, in a thread of this process, over `engine` or a
    new one-process engine with these settings."""

    def __init__(self, model_dir: Path, api_key: str | None = None, max_waiting: int | None = None,
                 engine=None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, tool_call_parser: str | None = None,
                 body_read_timeout: float = DEFAULT_BODY_READ_TIMEOUT, chat_template: str | None = None,
                 default_chat_template_kwargs: dict | None = None, **settings) -> None:
        self.engine = engine if engine is not None else LLMEngine(model_dir, EngineConfig(**{**ENGINE, **settings}))
        self.app = build_app(self.engine, MODEL_NAME, api_key, max_waiting, max_request_bytes,
                             tool_call_parser=tool_call_parser, body_read_timeout=body_read_timeout,
                             chat_template=chat_template, default_chat_template_kwargs=default_chat_template_kwargs)
        self.async_engine = self.app.state.engine
        sock = free_socket()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until the engine holds no request (aborts are applied on the engine thread)."""
        deadline = time.monotonic() + timeout
        while self.engine.has_unfinished_requests() or self.async_engine.num_waiting():
            assert time.monotonic() < deadline, "requests are still in the engine"
            time.sleep(0.01)


@pytest.fixture(scope="session")
def server(model_dir):
    """The main server: API key required."""
    live = LiveServer(model_dir, api_key=API_KEY)
    yield live
    live.stop()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as client:
        yield client
