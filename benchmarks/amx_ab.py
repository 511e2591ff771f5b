"""The avx512_amx build (int8, int4, Q6_K, Q5_0, Q5_1, Q5_K and Q4_K blocks on AMX tiles, kernels/amx.c) against the
avx512_bf16 build (vpdpbusd) in one process, on the same weights and activations, taking turns call by call; checks
that both give the same outputs bit for bit (random weights: the k-quants' shapes need inputs a multiple of 256). Per
format, shape (out x in) and row count: each build's best time per call over --repeats, and the ratio bf16 / amx of
the best times with the range of the per-round ratios.

`--clock thread` (the default at 1 thread) times by the calling thread's CPU time; `--clock cpu` by the process's
CPU time over the thread count (set `OMP_WAIT_POLICY=passive`, so that waiting threads do not spin). On a loaded
machine the wall clock mostly measures the other processes.

Run: `PYTHONPATH=$PWD .venv/bin/python benchmarks/amx_ab.py [--rows 512] [--formats int8,int4,q6_k,q5_0,q5_1,q5_k,q4_k]
[--group 32] [--shapes 1408x2048,2816x2048] [--threads 1] [--repeats 3]`.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from latentserve.kernels import native  # noqa: E402
from latentserve.layers.quant.int4 import quantize_int4  # noqa: E402
from latentserve.layers.quant.int8 import quantize_int8  # noqa: E402

# V3-shaped models' products at 2048 inputs: experts' down and gate_up (1408), dense MLP (10944), lm_head (102400).
SHAPES = "1408x2048,2816x2048,10944x2048,2048x1408,102400x2048"


def _clock(kind: str, threads: int):
    if kind == "thread":
        return time.thread_time
    return lambda: time.process_time() / threads


def _product(fmt: str, group: int, n: int, k: int):
    """(call(kernels, x), description) for one weight of `fmt`."""
    w = torch.randn(n, k) * 0.05
    if fmt == "int8":
        packed = native.pack_int8(*quantize_int8(w))
        return lambda kern, x: native.int8_linear(kern, x, packed, n, x.dtype), "int8"
    if fmt in ("q5_0", "q5_1"):
        q, d = torch.randint(0, 32, (n, k), dtype=torch.uint8), (torch.rand(n, k // 32) * 1e-2).half()
        if fmt == "q5_0":
            packed, linear = native.pack_q50(q, d), native.q50_linear
        else:
            m = (-16 * d.float() * torch.rand(n, k // 32)).half()
            packed, linear = native.pack_q51(q, d, m), native.q51_linear
        return lambda kern, x: linear(kern, x, packed, n, x.dtype), fmt.upper()
    if fmt == "q6_k":
        q, d = torch.randint(0, 64, (n, k), dtype=torch.uint8), (torch.rand(n, k // 256) * 1e-3).half().float()
        packed = native.pack_q6k(q, d, torch.randint(-128, 128, (n, k // 16), dtype=torch.int8))
        return lambda kern, x: native.q6k_linear(kern, x, packed, n, x.dtype), "Q6_K"
    if fmt in ("q5_k", "q4_k"):
        bits = int(fmt[1])
        d, dmin = ((torch.rand(n, k // 256) * 1e-3).half().float() for _ in range(2))
        sc, m = (torch.randint(0, 64, (n, k // 32), dtype=torch.uint8) for _ in range(2))
        q = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8)
        pack, linear = (native.pack_q5k, native.q5k_linear) if bits == 5 else (native.pack_q4k, native.q4k_linear)
        packed = pack(q, d, dmin, sc, m)
        return lambda kern, x: linear(kern, x, packed, n, x.dtype), fmt.replace("q", "Q").replace("_k", "_K")
    packed = native.pack_int4(*quantize_int4(w, group))
    return lambda kern, x: native.int4_linear(kern, x, packed, group, n, x.dtype), f"int4 g{group}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="512")
    parser.add_argument("--formats", default="int8,int4")
    parser.add_argument("--group", type=int, default=32, help="int4's group size")
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--clock", choices=("thread", "cpu"), default=None, help="default: thread at 1 thread")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = _clock(args.clock or ("thread" if args.threads == 1 else "cpu"), args.threads)
    builds = {}
    for isa in ("avx512_bf16", "avx512_amx"):
        built = native.load(isa)
        if isinstance(built, str):
            sys.exit(f"{isa} build unavailable: {built}")
        builds[isa] = built
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    print(f"threads {args.threads}, activations {args.dtype}; ms per call (best of {args.repeats}), bf16 / amx")
    for fmt in args.formats.split(","):
        for shape in args.shapes.split(","):
            n, k = map(int, shape.split("x"))
            if fmt in ("q6_k", "q5_k", "q4_k") and k % 256:
                continue  # the k-quants' superblocks: 256 columns (a file keeps such rows in Q5_0)
            call, name = _product(fmt, args.group, n, k)
            for m in map(int, args.rows.split(",")):
                x = torch.randn(m, k).to(dtype)
                outs = {isa: call(kern, x) for isa, kern in builds.items()}  # first calls: scratch, pages
                if not torch.equal(outs["avx512_bf16"].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                                   outs["avx512_amx"].view(torch.int16 if dtype == torch.bfloat16 else torch.int32)):
                    sys.exit(f"{name} {shape} at {m} rows: the builds' outputs differ")
                times = {isa: [] for isa in builds}
                for r in range(args.repeats):
                    for isa in (builds if r % 2 == 0 else reversed(builds)):
                        start = clock()
                        call(builds[isa], x)
                        times[isa].append(clock() - start)
                ratios = [b / a for a, b in zip(times["avx512_amx"], times["avx512_bf16"])]
                ref, amx = min(times["avx512_bf16"]), min(times["avx512_amx"])
                print(f"{name:9s} {shape:>11s} x {m:4d} rows: bf16 {ref * 1e3:8.2f}  amx {amx * 1e3:8.2f}  "
                      f"{ref / amx:.2f}x (rounds {min(ratios):.2f}-{max(ratios):.2f})", flush=True)


if __name__ == "__main__":
    main()
