"""serve: an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models, /metrics)."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from latentserve.cli.args import (
    CLIError,
    HelpFormatter,
    add_engine_args,
    add_generation_config_arg,
    build_llm,
    json_object,
    non_negative_float,
    positive_int,
    user_errors,
)
from latentserve.engine.chat_template import load_chat_template
from latentserve.engine.llm import default_model_dir
from latentserve.distributed.dp_engine import launched_by_torchrun
from latentserve.server import ServerConfig
from latentserve.server.api import CORS, DEFAULT_BODY_READ_TIMEOUT, DEFAULT_MAX_REQUEST_BYTES
from latentserve.server.launcher import make_app, serve_app, serving_engine
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
    p.add_argument("model_tag", nargs="?", metavar="MODEL", help="checkpoint directory, as --model (vLLM's form)")
    add_engine_args(p)
    g = p.add_argument_group("server")
    add_generation_config_arg(g)
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
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's switch for tool_choice auto; needs --tool-call-parser, which enables it here anyway")
    g.add_argument("--chat-template", default=None,
                   help="a jinja2 chat template, or the path of a file holding one (default: the tokenizer's)")
    g.add_argument("--default-chat-template-kwargs", type=json_object, default=None,
                   help='variables for the chat template, as JSON (e.g. \'{"thinking": true}\'); a request\'s '
                        'chat_template_kwargs win')
    g.add_argument("--allowed-origins", type=json_list, default=None,
                   help='browser origins allowed to call the server, as JSON: \'["https://app.example"]\' or '
                        '\'["*"]\' (default: no CORS headers, so browsers refuse other origins)')
    g.add_argument("--allowed-methods", type=json_list, default=["*"], help="with --allowed-origins: HTTP methods")
    g.add_argument("--allowed-headers", type=json_list, default=["*"], help="with --allowed-origins: request headers")
    g.add_argument("--allow-credentials", action="store_true", help="with --allowed-origins: allow cookies")
    g.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (with --ssl-certfile)")
    g.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (with --ssl-keyfile)")
    g.add_argument("--uvicorn-log-level", choices=["critical", "error", "warning", "info", "debug", "trace"],
                   default="info", help="uvicorn's log level")
    p.set_defaults(func=run)


def json_list(text: str) -> list[str]:
    """vLLM's form of a list flag: a JSON list of strings."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg}): {text!r}; expected a list like '[\"*\"]'") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings like '[\"*\"]', got {text!r}")
    return value


def resolve_model(args: argparse.Namespace) -> None:
    """`serve MODEL` (vLLM's form) and `--model MODEL` name the same thing: at most one may be given."""
    if args.model_tag is None:
        return
    if args.model is not None and args.model != args.model_tag:
        raise CLIError(f"the model is given twice ({args.model_tag!r} and --model {args.model!r}): give it once")
    args.model = args.model_tag


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The server settings of the flags (the API key from the environment when no flag gives it)."""
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise CLIError("--enable-auto-tool-choice needs --tool-call-parser (e.g. deepseek_v3) to find the calls")
    cors = None
    if args.allowed_origins is not None:
        cors = CORS(tuple(args.allowed_origins), tuple(args.allowed_methods), tuple(args.allowed_headers),
                    args.allow_credentials)
    elif args.allow_credentials:
        raise CLIError("--allow-credentials needs --allowed-origins")
    with user_errors():
        chat_template = load_chat_template(args.chat_template) if args.chat_template is not None else None
        return ServerConfig(host=args.host, port=args.port, api_key=api_key, max_waiting=args.max_waiting,
                            served_model_name=args.served_model_name, drain_timeout=args.drain_timeout,
                            max_request_bytes=args.max_request_bytes, body_read_timeout=args.body_read_timeout,
                            metrics_prefix=args.metrics_prefix,
                            log_level=args.uvicorn_log_level, tool_call_parser=args.tool_call_parser,
                            chat_template=chat_template,
                            default_chat_template_kwargs=args.default_chat_template_kwargs, cors=cors,
                            ssl_keyfile=args.ssl_keyfile,
                            ssl_certfile=args.ssl_certfile)


def run(args: argparse.Namespace) -> int:
    if launched_by_torchrun():
        raise CLIError("serve does not run under torchrun: start it as one process with --data-parallel-size N, "
                       "which spawns the ranks itself")
    resolve_model(args)
    config = server_config(args)
    llm = build_llm(args, generation_config=args.generation_config)
    name = (default_model_dir() if args.model is None else Path(args.model)).name
    try:
        with user_errors():  # e.g. a chat template for a model without a tokenizer
            app = make_app(serving_engine(llm), name, config)
        return serve_app(app, config)
    finally:
        llm.shutdown()
