"""`latentserve generate`: complete prompts, streaming the text to the terminal or printing JSON."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from latentserve.cli.args import (
    CLIError,
    HelpFormatter,
    add_engine_args,
    add_sampling_args,
    build_llm,
    sampling_params_from_args,
    user_errors,
    write,
)
from latentserve.cli.streaming import TextStreamer, check_finished, run_engine
from latentserve.engine.llm_engine import LLMEngine
from latentserve.engine.outputs import RequestOutput

DEFAULT_PROMPT = "And God said"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="complete prompts", description=__doc__.split(":", 1)[1].strip(),
                              formatter_class=HelpFormatter)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--prompt", help=f"the prompt (default: {DEFAULT_PROMPT!r})")
    source.add_argument("--prompts-file", type=Path, help="a file with one prompt per line")
    p.add_argument("--json", action="store_true", help="print one JSON list of results instead of streaming text")
    add_sampling_args(p, max_tokens=64)
    add_engine_args(p)
    p.set_defaults(func=run)


def read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompts_file is None:
        return [DEFAULT_PROMPT if args.prompt is None else args.prompt]
    with user_errors():
        lines = args.prompts_file.read_text(encoding="utf-8").splitlines()
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise CLIError(f"prompts file {args.prompts_file} has no prompts (one per line)")
    return prompts


def run(args: argparse.Namespace) -> int:
    prompts = read_prompts(args)
    params = sampling_params_from_args(args)
    engine = build_llm(args).engine
    with user_errors():  # every prompt is checked (tokenizer, length) before any runs
        requests = [engine.make_request(prompt, params) for prompt in prompts]
    for request in requests:
        engine.scheduler.add_request(request)
    order = [r.request_id for r in requests]
    if args.json:
        return _run_json(engine, order)
    if len(prompts) == 1:
        return _run_streaming(engine, prompts[0])
    return _run_labelled(engine, order)


def _run_streaming(engine: LLMEngine, prompt: str) -> int:
    write(prompt)
    streamer = TextStreamer()
    run_engine(engine, streamer)
    write("\n")
    check_finished(streamer.last)
    return 0


def _run_labelled(engine: LLMEngine, order: list[str]) -> int:
    """Several prompts run as one batch; each completion is printed whole when it finishes."""
    index = {request_id: i for i, request_id in enumerate(order)}
    failed: list[RequestOutput] = []

    def on_output(output: RequestOutput) -> None:
        if not output.finished:
            return
        completion = output.outputs[0]
        if completion.finish_reason == "error":
            failed.append(output)
            return
        write(f"=== [{index[output.request_id]}] {output.prompt!r} ({completion.finish_reason}, "
              f"{len(completion.token_ids)} tokens)\n{output.prompt}{completion.text}\n")

    run_engine(engine, on_output)
    for output in failed:
        check_finished(output)
    return 0


def _run_json(engine: LLMEngine, order: list[str]) -> int:
    latest: dict[str, RequestOutput] = {}

    def on_output(output: RequestOutput) -> None:
        latest[output.request_id] = output

    run_engine(engine, on_output)
    outputs = [latest[request_id] for request_id in order]
    results = [
        dict(prompt=o.prompt, text=o.outputs[0].text, token_ids=o.outputs[0].token_ids,
             prompt_token_ids=o.prompt_token_ids, finish_reason=o.outputs[0].finish_reason, error=o.error)
        for o in outputs
    ]
    write(json.dumps(results, ensure_ascii=False, indent=2) + "\n")
    for output in outputs:
        check_finished(output)
    return 0
