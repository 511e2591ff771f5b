"""serve: an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models, /metrics)."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from latentserve.cli.args import CLIError, HelpFormatter, add_engine_args, build_llm, non_negative_float, positive_int
from latentserve.engine.llm import default_model_dir
from latentserve.distributed.dp_engine import launched_by_torchrun
from latentserve.server import ServerConfig, serve
from latentserve.server.api import DEFAULT_BODY_READ_TIMEOUT, DEFAULT_MAX_REQUEST_BYTES
from latentserve.server.launcher import serving_engine
from latentserve.server.tool_parsers import tool_parser_names

API_KEY_ENV = "LATENTSERVE_API_KEY"


def positive_float(text: str) -> float:
    value = non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be > 0, got 0")
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                              description=__doc__.split(":", 1)[1].strip(), formatter_class=HelpFormatter)
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=positive_int, default=8000, help="port to listen on")
    g.add_argument("--api-key", default=None,
                   help=f"require `Authorization: Bearer KEY` on /v1 routes (default: ${API_KEY_ENV} if set; the "
                        "variable keeps the key out of the process list)")
    g.add_argument("--max-waiting", type=positive_int, default=None,
                   help="requests the engine cannot admit yet, beyond which new ones get 503")
    g.add_argument("--served-model-name", default=None, help="model name clients send (default: the folder name)")
    g.add_argument("--max-request-bytes", type=positive_int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="larger request bodies get 413")
    g.add_argument("--body-read-timeout", type=positive_float, default=DEFAULT_BODY_READ_TIMEOUT,
                   help="seconds a request body may stall before its end (then 408)")
    g.add_argument("--drain-timeout", type=non_negative_float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    g.add_argument("--metrics-prefix", choices=["latentserve", "vllm"], default="latentserve",
                   help="/metrics names are PREFIX:<vLLM's metric name>; vllm gives vLLM's exact names")
    g.add_argument("--tool-call-parser", choices=tool_parser_names(), default=None,
                   help="find tool calls in the model's output format (needed for tool_choice auto)")
    p.set_defaults(func=run)


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The server settings of the flags (the API key from the environment when no flag gives it)."""
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    return ServerConfig(host=args.host, port=args.port, api_key=api_key, max_waiting=args.max_waiting,
                        served_model_name=args.served_model_name, drain_timeout=args.drain_timeout,
                        max_request_bytes=args.max_request_bytes, body_read_timeout=args.body_read_timeout,
                        metrics_prefix=args.metrics_prefix,
                        tool_call_parser=args.tool_call_parser)


def run(args: argparse.Namespace) -> int:
    if launched_by_torchrun():
        raise CLIError("serve does not run under torchrun: start it as one process with --data-parallel-size N, "
                       "which spawns the ranks itself")
    config = server_config(args)
    llm = build_llm(args)
    name = (default_model_dir() if args.model is None else Path(args.model)).name
    try:
        return serve(serving_engine(llm), name, config)
    finally:
        llm.shutdown()
