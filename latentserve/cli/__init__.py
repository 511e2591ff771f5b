"""The `latentserve` command: generate | chat | bench | serve | quantize | backends."""
from __future__ import annotations

import sys
from typing import Sequence

from latentserve.cli import backends, bench, chat, generate, quantize, serve
from latentserve.cli.args import ArgumentParser, CLIError


def make_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="latentserve", description="Inference for Multi-head Latent Attention models.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (generate, chat, bench, serve, quantize, backends):
        command.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; user mistakes print one line on stderr (exit 2 for flags, 1 for the rest)."""
    args = make_parser().parse_args(argv)
    try:
        return args.func(args)
    except CLIError as e:
        print(f"latentserve: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `| head`: the reader left, nothing more to say
        sys.stderr.close()
        return 0
