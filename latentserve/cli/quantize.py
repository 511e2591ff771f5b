"""`latentserve quantize`: load a checkpoint quantized to int8 or int4 and save it as it runs, so that later starts
map it instead of quantizing again (`--model DIR` on every command)."""
from __future__ import annotations

import argparse
from pathlib import Path

from latentserve.cli.args import CLIError, HelpFormatter, dtype_name, positive_int, user_errors, write
from latentserve.engine.llm import LLM, default_model_dir


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("quantize", help="save an int8 / int4 model that later starts without quantizing",
                              description=__doc__.split(":", 1)[1].strip(), formatter_class=HelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    p.add_argument("--quantization", choices=["int8", "int4"], required=True, help="weight format to save")
    p.add_argument("--quantization-group-size", type=positive_int, default=None,
                   help="int4: input columns per scale (32, 64 or 128; default: per layer, the largest that divides "
                        "its input)")
    p.add_argument("--lm-head-quantized", action=argparse.BooleanOptionalAction, default=None,
                   help="quantize lm_head too (default: yes)")
    p.add_argument("--dtype", type=dtype_name, default="auto", help="compute dtype the saved model runs in")
    p.add_argument("--output", type=Path, default=None, help="new folder to write (default: MODEL-QUANTIZATION)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    source = Path(args.model) if args.model is not None else default_model_dir()
    output = args.output if args.output is not None else source.with_name(f"{source.name}-{args.quantization}")
    if output.exists() and any(output.iterdir()):
        raise CLIError(f"{output} is not empty: pass a new --output folder")
    with user_errors():
        # One block of KV cache: the engine is only loaded to be saved.
        llm = LLM(source, dtype=args.dtype, quantization=args.quantization,
                  quantization_group_size=args.quantization_group_size, lm_head_quantized=args.lm_head_quantized,
                  block_size=16, max_model_len=16, num_kv_blocks=1)
        path = llm.save_quantized(output)
    size = sum(f.stat().st_size for f in path.iterdir())
    write(f"saved {args.quantization} model to {path} ({size / 2**20:.1f} MiB); run it with --model {path}\n")
    return 0
