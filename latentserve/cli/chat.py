"""`latentserve chat`: talk to the model in the terminal, one user line per turn, with its chat template."""
from __future__ import annotations

import argparse
import sys

from latentserve.cli.args import (
    CLIError,
    HelpFormatter,
    add_engine_args,
    add_sampling_args,
    build_llm,
    json_object,
    sampling_params_from_args,
    user_errors,
    write,
)
from latentserve.cli.streaming import TextStreamer, check_finished, run_engine
from latentserve.engine.chat_template import chat_prompt_ids

EXIT_COMMAND = "/exit"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "chat", help="interactive chat", formatter_class=HelpFormatter,
        description=__doc__.split(":", 1)[1].strip() + f" Reads stdin; ends at end of input or {EXIT_COMMAND}.",
    )
    add_sampling_args(p, max_tokens=128)
    p.add_argument("--chat-template-kwargs", type=json_object, default=None,
                   help='variables for the chat template, as JSON (e.g. \'{"thinking": true}\')')
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    params = sampling_params_from_args(args)
    llm = build_llm(args)
    engine = llm.engine
    if engine.tokenizer is None:
        raise CLIError(f"the model in {llm.model_dir} has no tokenizer.json: chat needs one")
    options = dict(chat_template_kwargs=args.chat_template_kwargs)
    with user_errors():  # no chat template, one that does not compile, or variables it does not read
        chat_prompt_ids(engine.tokenizer, [dict(role="user", content="")], **options)
    interactive = sys.stdin.isatty()
    messages: list[dict[str, str]] = []
    while True:
        if interactive:
            write("> ")
        line = sys.stdin.readline()
        if not line or line.strip() == EXIT_COMMAND:
            if interactive and not line:
                write("\n")  # end the prompt line after Ctrl-D
            return 0
        messages.append(dict(role="user", content=line.rstrip("\n")))
        with user_errors():  # e.g. the template rejects the turn, or the conversation outgrew max_model_len
            engine.add_request(chat_prompt_ids(engine.tokenizer, messages, **options), params)
        streamer = TextStreamer()
        run_engine(engine, streamer)
        write("\n")
        check_finished(streamer.last)
        messages.append(dict(role="assistant", content=streamer.last.outputs[0].text))
