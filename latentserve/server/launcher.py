"""Running the app under uvicorn, with a graceful drain on SIGTERM / SIGINT."""
from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import uvicorn
from fastapi import FastAPI

from latentserve.engine.llm import LLM, default_model_dir
from latentserve.engine.engine_config import EngineConfig
from latentserve.server.api import CORS, DEFAULT_BODY_READ_TIMEOUT, DEFAULT_MAX_REQUEST_BYTES, ServerState, build_app
from latentserve.server.async_engine import AsyncLLMEngine, Engine

logger = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # when set, /v1 routes need `Authorization: Bearer <api_key>`
    max_waiting: int | None = None  # more waiting requests than this get 503; None: no limit
    served_model_name: str | None = None  # the `model` clients send; default: the model directory's name
    drain_timeout: float = 30.0  # seconds in-flight requests get to finish after SIGTERM
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # larger request bodies get 413
    body_read_timeout: float = DEFAULT_BODY_READ_TIMEOUT  # a body stalled this many seconds before its end gets 408
    metrics_prefix: str = "latentserve"  # /metrics names are <prefix>:<vLLM's name>; "vllm" gives vLLM's exact names
    log_level: str = "info"
    tool_call_parser: str | None = None  # e.g. deepseek_v3: tool_choice "auto" finds calls in the model's format
    chat_template: str | None = None  # replaces the tokenizer's (the template's text)
    default_chat_template_kwargs: dict | None = None  # template variables; a request's chat_template_kwargs win
    cors: CORS | None = None  # None: no CORS headers
    ssl_keyfile: str | None = None  # with ssl_certfile: serve HTTPS
    ssl_certfile: str | None = None

    def __post_init__(self) -> None:
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("HTTPS needs both ssl_keyfile and ssl_certfile (--ssl-keyfile, --ssl-certfile)")
        for name in ("ssl_keyfile", "ssl_certfile"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise FileNotFoundError(f"{name} {path} does not exist")


class DrainingServer(uvicorn.Server):
    """On the first SIGTERM/SIGINT: refuse new requests (503), let in-flight ones finish (bounded), then exit with
    status 0; a second signal exits at once.

    If the engine fails (a data-parallel rank died, a step raised), its requests have been answered with errors and it
    serves nothing more: the server stops at once with `exit_code` 1, for a supervisor to restart it.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState, engine: AsyncLLMEngine,
                 drain_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.engine = engine
        self.drain_timeout = drain_timeout
        self.drain_deadline: float | None = None
        self.exit_code = 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in _captured_signals: uvicorn would re-raise it after shutdown and die by the signal.
        if self.drain_deadline is not None:
            self.should_exit = self.force_exit = True
            return
        logger.info("signal %d: draining %d in-flight request(s)", sig, self.state.in_flight)
        self.state.draining = True
        self.drain_deadline = time.monotonic() + self.drain_timeout

    async def on_tick(self, counter: int) -> bool:
        if self.engine.error is not None and not self.exit_code:
            logger.error("the engine failed, exiting with status 1 (restart the server): %s", self.engine.error)
            self.state.draining = True  # until the listener closes, new requests get 503
            self.exit_code, self.should_exit = 1, True
        if self.drain_deadline is not None and not self.should_exit:
            self.should_exit = self.state.in_flight == 0 or time.monotonic() > self.drain_deadline
        return await super().on_tick(counter)


def log_config(level: str) -> dict:
    """uvicorn's logging setup, with latentserve's own loggers on its handler (else only warnings would show)."""
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["loggers"]["latentserve"] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    return config


def make_app(engine: Engine, model_name: str, config: ServerConfig) -> FastAPI:
    """The app `serve` runs: `engine` served as `model_name` (or config.served_model_name) with `config`."""
    return build_app(engine, config.served_model_name or model_name, config.api_key, config.max_waiting,
                     config.max_request_bytes, config.metrics_prefix, config.tool_call_parser, config.body_read_timeout,
                     config.chat_template, config.cors, config.default_chat_template_kwargs)


def serve(engine: Engine, model_name: str, config: ServerConfig) -> int:
    """Serve a loaded engine as `model_name` until SIGTERM / SIGINT (status 0) or until the engine fails (1)."""
    return serve_app(make_app(engine, model_name, config), config)


def serve_app(app: FastAPI, config: ServerConfig) -> int:
    """Run an app of `make_app` on config's address until SIGTERM / SIGINT (status 0) or until the engine fails (1)."""
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                               log_config=log_config(config.log_level),
                               timeout_graceful_shutdown=max(int(config.drain_timeout), 1),
                               ssl_keyfile=config.ssl_keyfile, ssl_certfile=config.ssl_certfile)
    server = DrainingServer(uv_config, app.state.server_state, app.state.engine, config.drain_timeout)
    server.run()
    return server.exit_code


def serving_engine(llm: LLM) -> Engine:
    """The engine a server drives: one process's, or the front end of the ranks `llm` spawned."""
    if llm.engine is None:
        raise ValueError("the server cannot run under torchrun: start it as one process with "
                         "data_parallel_size=N (--data-parallel-size N), which spawns the ranks itself")
    return llm.engine


def run_server(model: str | Path | None, engine_config: EngineConfig, config: ServerConfig) -> int:
    """Load the model (None: the embedded one) and serve it; its name defaults to the directory's name. The exit
    status: 0 after SIGTERM, 1 if the engine failed."""
    model_dir = Path(model) if model is not None else default_model_dir()
    llm = LLM(model_dir, **{name: getattr(engine_config, name) for name in EngineConfig.__dataclass_fields__})
    try:
        return serve(serving_engine(llm), model_dir.name, config)
    finally:
        llm.shutdown()
