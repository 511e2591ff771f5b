"""vLLM's flags that have no counterpart here, so that a `vllm serve` line gets a clear answer rather than
argparse's "unrecognized arguments": a flag is refused with the reason (and what to use instead), accepted at the one
value that means what latentserve does anyway (`--tensor-parallel-size 1`), or accepted with a note saying why it
changes nothing (`--trust-remote-code`)."""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

NOTES_DEST = "vllm_notes"


@dataclass(frozen=True)
class VLLMFlag:
    names: tuple[str, ...]
    reason: str
    takes_value: bool = True
    accepted: tuple[str, ...] = ()  # values that mean what latentserve does anyway
    note: bool = False  # accepted as a no-op, with `reason` printed as a note


_NOT_SPLIT = ("latentserve does not split layers over devices; on one machine use --data-parallel-size N "
              "--enable-expert-parallel (attention data-parallel, routed experts split over the ranks)")
_LOCAL = "nothing is downloaded: MODEL is a local checkpoint directory"

FLAGS = (
    VLLMFlag(("--tensor-parallel-size", "-tp"), _NOT_SPLIT, accepted=("1",)),
    VLLMFlag(("--pipeline-parallel-size", "-pp"), _NOT_SPLIT, accepted=("1",)),
    VLLMFlag(("--gpu-memory-utilization",), "the KV cache is not sized as a share of GPU memory: give its size with "
             "--kv-cache-memory-bytes (or --num-kv-blocks)"),
    VLLMFlag(("--num-gpu-blocks-override",), "use --num-kv-blocks"),
    VLLMFlag(("--swap-space",), "preempted requests are recomputed, never swapped out"),
    VLLMFlag(("--cpu-offload-gb",), "weights are not offloaded: --quantization int8 or int4 makes them smaller"),
    VLLMFlag(("--distributed-executor-backend",), "latentserve spawns its ranks itself (--data-parallel-size N) "
             "or runs under torchrun"),
    VLLMFlag(("--download-dir",), _LOCAL),
    VLLMFlag(("--revision",), _LOCAL),
    VLLMFlag(("--tokenizer-revision",), _LOCAL),
    VLLMFlag(("--trust-remote-code",), "latentserve runs its own DeepSeek code and never executes a checkpoint's, "
             "so there is nothing to trust: the flag changes nothing", takes_value=False, note=True),
    VLLMFlag(("--enforce-eager",), "the model always runs eagerly (there are no CUDA graphs): the flag changes "
             "nothing", takes_value=False, note=True),
    VLLMFlag(("--disable-log-requests",), "requests are never logged: the flag changes nothing", takes_value=False,
             note=True),
    VLLMFlag(("--disable-log-stats",), "no periodic stats are logged (see /metrics): the flag changes nothing",
             takes_value=False, note=True),
)


class _VLLMFlagAction(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, flag: VLLMFlag, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=None if flag.takes_value else 0, default=argparse.SUPPRESS,
                         **kwargs)
        self.flag = flag

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values,
                 option_string: str | None = None) -> None:
        if self.flag.note:
            # A new list: the default one is shared by every parse.
            setattr(namespace, NOTES_DEST, [*getattr(namespace, NOTES_DEST), f"{option_string}: {self.flag.reason}"])
        elif values not in self.flag.accepted:
            parser.error(f"{option_string} {values}: {self.flag.reason}")


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("vLLM flags without a counterpart (refused with the reason, or a no-op noted)")
    parser.set_defaults(**{NOTES_DEST: []})
    for flag in FLAGS:
        accepted = f" (accepted: {', '.join(flag.accepted)})" if flag.accepted else ""
        g.add_argument(*flag.names, action=_VLLMFlagAction, flag=flag, help=flag.reason + accepted)


def print_notes(args: argparse.Namespace) -> None:
    """What the accepted no-op flags of the command line do not do, one line each on stderr."""
    for note in getattr(args, NOTES_DEST, []):
        print(f"latentserve: note: {note}", file=sys.stderr)
