"""`latentserve chat`: talk to the model in the terminal, one user line per turn, with its chat template."""
from __future__ import annotations

import argparse
import sys

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

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
from latentserve.engine.detokenizer import TokenizerInfo

EXIT_COMMAND = "/exit"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "chat", help="interactive chat", formatter_class=HelpFormatter,
        description=__doc__.split(":", 1)[1].strip() + f" Reads stdin; ends at end of input or {EXIT_COMMAND}.",
    )
    add_sampling_args(p, max_tokens=128)
    add_engine_args(p)
    p.set_defaults(func=run)


class ChatTemplate:
    """A tokenizer's Jinja chat template, rendered the way transformers' `apply_chat_template` does."""

    def __init__(self, tokenizer: TokenizerInfo) -> None:
        if tokenizer.chat_template is None:
            raise CLIError("this model's tokenizer_config.json has no chat_template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        try:
            self.template = env.from_string(tokenizer.chat_template)
        except jinja2.TemplateError as e:
            raise CLIError(f"the model's chat_template does not compile: {e}") from e
        token = tokenizer.tokenizer.id_to_token
        self.special_tokens = dict(
            bos_token=token(tokenizer.bos_token_id) if tokenizer.bos_token_id is not None else "",
            eos_token=token(tokenizer.eos_token_id) if tokenizer.eos_token_id is not None else "",
        )

    def render(self, messages: list[dict[str, str]]) -> str:
        """The prompt text that asks for the assistant's next reply."""
        try:
            return self.template.render(messages=messages, add_generation_prompt=True, **self.special_tokens)
        except jinja2.TemplateError as e:
            raise CLIError(f"the model's chat_template failed: {e}") from e


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def run(args: argparse.Namespace) -> int:
    params = sampling_params_from_args(args)
    llm = build_llm(args)
    engine = llm.engine
    if engine.tokenizer is None:
        raise CLIError(f"the model in {llm.model_dir} has no tokenizer.json: chat needs one")
    template = ChatTemplate(engine.tokenizer)
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
        # The template writes the special tokens itself; encoding it must not add a second BOS.
        token_ids = engine.tokenizer.encode(template.render(messages), add_special_tokens=False)
        with user_errors():  # e.g. the conversation outgrew max_model_len
            engine.add_request(token_ids, params)
        streamer = TextStreamer()
        run_engine(engine, streamer)
        write("\n")
        check_finished(streamer.last)
        messages.append(dict(role="assistant", content=streamer.last.outputs[0].text))
