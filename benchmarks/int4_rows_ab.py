"""The int4 linear kernel (`ls_int4_linear`) at many rows (prefill) in two source trees, in one process, taking turns
call by call: each tree's kernel sources compiled into a library of their own (`int8_linear_ab.kernels_of`), both
run on the same weights and activations, and their outputs checked equal bit for bit (`--rounding`: within
rounding, where B changes the float operations' order).

Per shape (out x in), group size and row count: in each round A's calls then B's (the order alternating), each
timed by the process's CPU time over the thread count (set `OMP_WAIT_POLICY=passive`, so that waiting threads do
not spin; on a loaded machine the wall clock mostly measures the other processes), over enough calls for about
--batch-ms of work; printed: the median ms per call of each and A / B's median over the rounds with its range.

Run: `OMP_WAIT_POLICY=passive PYTHONPATH=$PWD .venv/bin/python benchmarks/int4_rows_ab.py --a OLD_TREE --b .
[--rows 16,48,128,512] [--groups 32,64,128] [--shapes 2816x2048,2048x1408,3072x1536] [--isa avx2] [--rounding]`.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.int8_linear_ab import kernels_of  # noqa: E402
from latentserve.kernels import build, native  # noqa: E402
from latentserve.kernels.cpu import cpu_features  # noqa: E402
from latentserve.layers.quant.int4 import quantize_int4  # noqa: E402


def per_call(kern: native.NativeKernels, x: torch.Tensor, w: torch.Tensor, group: int, n: int, calls: int,
             threads: int) -> float:
    """CPU seconds per call over `calls` calls."""
    start = time.process_time()
    for _ in range(calls):
        native.int4_linear(kern, x, w, group, n)
    return (time.process_time() - start) / threads / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", required=True, help="the tree timed as the reference")
    parser.add_argument("--b", default=".")
    parser.add_argument("--rows", default="16,48,128,512")
    parser.add_argument("--groups", default="32,64,128")
    parser.add_argument("--shapes", default="2816x2048,2048x1408,3072x1536")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch-ms", type=float, default=40.0, help="CPU time of one tree's calls in a round")
    parser.add_argument("--isa", default=build.kernel_isa(cpu_features())[0])
    parser.add_argument("--rounding", action="store_true", help="outputs equal within rounding, not bit for bit")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    trees = {"A": kernels_of(args.a, args.isa), "B": kernels_of(args.b, args.isa)}
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"{args.isa}, {args.threads} threads, CPU clock, {args.rounds} rounds, {when}, "
          f"load average {os.getloadavg()}")
    print("| shape | group | rows | A ms | B ms | A / B median | range |\n|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        weight = torch.randn(n, k) * 0.02
        for group in map(int, args.groups.split(",")):
            packed = native.pack_int4(*quantize_int4(weight, group))
            for rows in map(int, args.rows.split(",")):
                x = torch.randn(rows, k)
                a, b = (native.int4_linear(kern, x, packed, group, n) for kern in trees.values())
                if not (torch.allclose(a, b, rtol=1e-5, atol=1e-5 * a.abs().max().item()) if args.rounding
                        else torch.equal(a, b)):
                    sys.exit(f"{shape}, group {group}, {rows} rows: A and B give different outputs")
                calls = max(1, round(args.batch_ms * 1e-3 / per_call(trees["A"], x, packed, group, n, 1, args.threads)))
                times: dict[str, list[float]] = {name: [] for name in trees}
                for r in range(args.rounds):
                    for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                        times[name].append(per_call(trees[name], x, packed, group, n, calls, args.threads))
                ratios = [ta / tb for ta, tb in zip(times["A"], times["B"])]
                print(f"| {shape} | {group} | {rows} | {statistics.median(times['A']) * 1e3:.3f} | "
                      f"{statistics.median(times['B']) * 1e3:.3f} | {statistics.median(ratios):.2f}x | "
                      f"{min(ratios):.2f}-{max(ratios):.2f} |", flush=True)


if __name__ == "__main__":
    main()
