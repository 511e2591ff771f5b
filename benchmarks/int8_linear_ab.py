"""The int8 linear kernel (`ls_int8_linear`) of two source trees in one process, taking turns call by call: each
tree's kernel sources are compiled into a library of their own (`kernels/build.py`'s cache) and both run the same
weights and activations, so a kernel change is timed against the code before it under the same noise. Checks that
both give the same outputs bit for bit.

Per shape (out x in) and row count: each kernel's best time per call over --repeats, cycling over enough copies of
the weight (96 MB) that every call reads it from memory, as decode does; and A's time over B's. `--clock cpu` (the
default) times by the process's CPU time over the thread count (set `OMP_WAIT_POLICY=passive`, so that waiting
threads do not spin): on a loaded machine the wall clock mostly measures the other processes.

Run: `OMP_WAIT_POLICY=passive PYTHONPATH=$PWD .venv/bin/python benchmarks/int8_linear_ab.py --a OLD_TREE --b .
[--rows 1,8,32] [--shapes 5632x2048,102400x2048] [--threads 2] [--isa avx512_vnni]`.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import beyond_cache  # noqa: E402
from latentserve.kernels import build, native  # noqa: E402
from latentserve.kernels.cpu import cpu_features  # noqa: E402
from latentserve.layers.quant.int8 import quantize_int8  # noqa: E402

STREAM_BYTES = beyond_cache(96 << 20, 3)  # copies of a weight: at least three times the L3


def kernels_of(tree: str, isa: str) -> native.NativeKernels:
    """`isa`'s build of the kernel sources under `tree` (this tree's source file names; its own headers, which only
    key the cache: a header renamed or added in one tree is no error)."""
    directory = Path(tree).resolve() / "latentserve" / "kernels"
    sources, headers = build.SOURCES, build.HEADERS
    build.SOURCES = tuple(directory / p.name for p in sources)
    build.HEADERS = tuple(sorted(directory.glob("*.h")))
    try:
        return native.NativeKernels(isa, build._open(build._build(isa)))
    finally:
        build.SOURCES, build.HEADERS = sources, headers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", required=True, help="the tree timed as the reference")
    parser.add_argument("--b", default=".")
    parser.add_argument("--rows", default="1,2,4,8,16,32")
    parser.add_argument("--shapes", default="5632x2048,2048x2816,3072x1536,102400x2048")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--isa", default=build.kernel_isa(cpu_features())[0])
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else lambda: time.process_time() / args.threads
    trees = {"A": kernels_of(args.a, args.isa), "B": kernels_of(args.b, args.isa)}
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"{args.isa}, {args.threads} threads, {args.clock} clock, {when}, load average {os.getloadavg()}")
    print("| shape | rows | A ms | B ms | A / B |\n|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        n, k = map(int, shape.split("x"))
        q, scale = quantize_int8(torch.randn(n, k) * 0.02)
        packed = [native.pack_int8(q.clone(), scale) for _ in range(max(1, STREAM_BYTES // (n * k)))]
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k)
            a, b = (native.int8_linear(kern, x, packed[0], n) for kern in trees.values())
            if not torch.equal(a, b):
                sys.exit(f"{shape} at {rows} rows: A and B give different outputs")
            best = dict.fromkeys(trees, float("inf"))
            for _ in range(args.repeats):
                for name, kern in trees.items():
                    start = clock()
                    for w in packed:
                        native.int8_linear(kern, x, w, n)
                    best[name] = min(best[name], (clock() - start) / len(packed))
            print(f"| {shape} | {rows} | {best['A'] * 1e3:.3f} | {best['B'] * 1e3:.3f} | "
                  f"{best['A'] / best['B']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
