"""vLLM's flags that have no counterpart here (engine/vllm_options.py's table) on the command line, so that a `vllm
serve` line gets a clear answer rather than argparse's "unrecognized arguments"."""
from __future__ import annotations

import argparse
import sys

from latentserve.engine.vllm_options import OPTIONS, VLLMOption

NOTES_DEST = "vllm_notes"


class _VLLMFlagAction(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, flag: VLLMOption, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=None if flag.takes_value else 0, default=argparse.SUPPRESS,
                         **kwargs)
        self.flag = flag

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values,
                 option_string: str | None = None) -> None:
        if not self.flag.takes_value:  # a switch given: True
            if True not in self.flag.accepted:
                parser.error(f"{option_string}: {self.flag.reason}")
            if self.flag.note:  # a new list: the default one is shared by every parse
                setattr(namespace, NOTES_DEST,
                        [*getattr(namespace, NOTES_DEST), f"{option_string}: {self.flag.reason}"])
        elif values not in [str(value) for value in self.flag.accepted]:
            parser.error(f"{option_string} {values}: {self.flag.reason}")


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("vLLM flags without a counterpart (refused with the reason, or a no-op noted)")
    parser.set_defaults(**{NOTES_DEST: []})
    for flag in OPTIONS:
        accepted = f" (accepted: {', '.join(map(str, flag.accepted))})" if flag.accepted and flag.takes_value else ""
        g.add_argument(*flag.names, action=_VLLMFlagAction, flag=flag, help=flag.reason + accepted)


def print_notes(args: argparse.Namespace) -> None:
    """What the accepted no-op flags of the command line do not do, one line each on stderr."""
    for note in getattr(args, NOTES_DEST, []):
        print(f"latentserve: note: {note}", file=sys.stderr)
