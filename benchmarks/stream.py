"""Weight streaming of the quantized linears at 1-8 rows (decode): bytes of weight read per second by the int8 and
int4 layers' kernel (`quant_linear`) and by the old int8 row kernel (`int8_heads`), against the copy bandwidth
measured in the same round.

At a few rows a linear layer is bound by reading its weight from memory, so the figure that says whether a kernel is
done is its weight bandwidth as a fraction of what the machine's memory gives. The reference is a torch `copy_` of 512
MB (2 x 16 times a 32 MiB L3; at least 4x a larger one) at the same thread count, counted as bytes read + bytes written
(STREAM's "copy"): a plain copy is what any program gets without tuning, and torch's runs on the same thread pool as the
kernels. Beside it, a torch `sum` of the same 512 MB (bytes read only): what a read-only stream such as a weight may
reach. The machine is shared and its bandwidth moves within minutes, so each round measures both references before each
shape's kernels, the kernels take turns call by call, every percentage is against its own round's copy, and the table
gives medians over rounds (GB/s and percentages) and the median of the rounds' ratios. `--clock cpu` times by the
process's CPU time (over the thread count): on a loaded machine wall time mostly measures who else ran.

Shapes (out x in): V2-Lite's routed expert gate_up (2816 x 2048) and down (2048 x 1408), V3's q LoRA q_a
(1536 x 2048) and q_b (3072 x 1536), lm_head (102400 x 2048). Each kernel cycles over enough copies of its weight
(STREAM_BYTES) that every call reads it from memory, as a model's layers do. int4 in groups of --group columns.
Run: `PYTHONPATH=$PWD .venv/bin/python benchmarks/stream.py [--threads 2] [--rounds 5]`.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import beyond_cache  # noqa: E402
from latentserve.kernels import native  # noqa: E402
from latentserve.kernels.cpu import cpu_features  # noqa: E402
from latentserve.layers.quant.int4 import quantize_int4  # noqa: E402
from latentserve.layers.quant.int8 import quantize_int8  # noqa: E402

SHAPES = {"gate_up": (2816, 2048), "down": (2048, 1408), "q_a": (1536, 2048), "q_b": (3072, 1536),
          "lm_head": (102400, 2048)}
ROWS = (1, 2, 4, 8)
KERNELS = ("int8", "int8 rows", "int4")
STREAM_BYTES = beyond_cache(128 << 20, 2)  # each kernel's copies of a weight: at least twice the L3
REFERENCE_BYTES = beyond_cache(512 << 20, 4)
MIN_CALLS = 8  # per kernel a round: lm_head's one copy is read 8 times


class Kernel:
    """`copies` distinct copies of one weight in a kernel's layout, and the bytes one call reads."""

    def __init__(self, call: Callable[[torch.Tensor, int], torch.Tensor], weight_bytes: int) -> None:
        self.call, self.weight_bytes = call, weight_bytes
        self.copies = max(1, STREAM_BYTES // weight_bytes)


def kernels(kernels_: native.NativeKernels, out_features: int, in_features: int, group: int) -> dict[str, Kernel]:
    w = torch.randn(out_features, in_features) * 0.02
    q8, s8 = quantize_int8(w)
    q4, s4, m4 = quantize_int4(w, group)
    del w
    qsum = q8.sum(dim=1, dtype=torch.int32)
    int8 = native.pack_int8(q8, s8)
    int4 = native.pack_int4(q4, s4, m4)
    made = {
        "int8": Kernel(lambda x, i: native.int8_linear(kernels_, x, packed8[i], out_features), int8.numel()),
        # q, its scales and its sums: what the row kernel reads
        "int8 rows": Kernel(lambda x, i: native.int8_heads(kernels_, x[:, None], rows8[i], s8, qsum),
                            q8.numel() + 8 * out_features),
        "int4": Kernel(lambda x, i: native.int4_linear(kernels_, x, packed4[i], group, out_features), int4.numel()),
    }
    packed8 = [int8.clone() for _ in range(made["int8"].copies)]
    rows8 = [q8[None].clone() for _ in range(made["int8 rows"].copies)]
    packed4 = [int4.clone() for _ in range(made["int4"].copies)]
    return made


def references(src: torch.Tensor, dst: torch.Tensor, clock: Callable[[], float]) -> tuple[float, float]:
    """(copy GB/s counting read + write, read-only GB/s), each the faster of two runs."""
    copy = min(_timed(lambda: dst.copy_(src), clock) for _ in range(2))
    read = min(_timed(lambda: src.sum(), clock) for _ in range(2))
    return 2 * src.nbytes / copy / 1e9, src.nbytes / read / 1e9


def _timed(fn: Callable[[], object], clock: Callable[[], float]) -> float:
    start = clock()
    fn()
    return clock() - start


def seconds(layers: dict[str, Kernel], x: torch.Tensor, clock: Callable[[], float]) -> dict[str, float]:
    """Mean seconds per call of each kernel, the kernels taking turns call by call (each sees the same moments of
    the machine), each call on the next of its copies."""
    total = dict.fromkeys(layers, 0.0)
    calls = max(MIN_CALLS, *(layer.copies for layer in layers.values()))
    for i in range(calls):
        for name, layer in layers.items():
            total[name] += _timed(lambda: layer.call(x, i % layer.copies), clock)
    return {name: t / calls for name, t in total.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--group", type=int, default=64, choices=(32, 64, 128), help="int4's group size")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of SHAPES")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: the process's CPU time over the thread count, steadier than wall time on a loaded "
                             "machine (time descheduled is not counted); run it with OMP_WAIT_POLICY=passive, or "
                             "threads spinning at a barrier count too")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else lambda: time.process_time() / args.threads
    features = cpu_features()
    built, why = native.native_kernels(features)
    if built is None:
        sys.exit(f"latentserve's kernels are not available here: {why}")
    shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    src = torch.ones(REFERENCE_BYTES // 4)
    dst = torch.empty_like(src)
    layers = {name: kernels(built, n, k, args.group) for name, (n, k) in shapes.items()}
    xs = {(name, m): torch.randn(m, k) for name, (_, k) in shapes.items() for m in ROWS}
    # per (shape, rows, kernel): GB/s and GB/s over the round's copy bandwidth, one entry a round
    gbs: dict[tuple, list[float]] = {}
    refs: dict[str, list[tuple[float, float]]] = {name: [] for name in shapes}
    loads = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for name in shapes:
            copy, read = references(src, dst, clock)
            refs[name].append((copy, read))
            for m in ROWS:
                for kernel, t in seconds(layers[name], xs[name, m], clock).items():
                    rate = layers[name][kernel].weight_bytes / t / 1e9
                    gbs.setdefault((name, m, kernel), []).append(rate)
                    gbs.setdefault((name, m, kernel, "copy"), []).append(rate / copy)
        loads.append(os.getloadavg()[0])
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"CPU: {features.describe()}; kernels {built.isa}; {args.threads} thread(s); {args.rounds} rounds; {when}; "
          f"load average {min(loads):.1f}-{max(loads):.1f}; int4 group {args.group}; {args.clock} clock")
    print("weight GB/s (% of the same round's copy), medians over rounds; 'int8 / rows': the row kernel's time over "
          "the blocks', median of the rounds' ratios")
    print("| shape | rows | copy GB/s | read GB/s | int8 | int8 rows | int8 / rows | int4 |")
    print("|---|---|---|---|---|---|---|---|")
    med = statistics.median
    for name, (n, k) in shapes.items():
        copy, read = med(c for c, _ in refs[name]), med(r for _, r in refs[name])
        for m in ROWS:
            cells = {kernel: f"{med(gbs[name, m, kernel]):.1f} ({100 * med(gbs[name, m, kernel, 'copy']):.0f}%)"
                     for kernel in KERNELS}
            # times are bytes / rate: the rows kernel reads 8 bytes an output less than the blocks' header
            ratio = med(b * layers[name]["int8 rows"].weight_bytes / (r * layers[name]["int8"].weight_bytes)
                        for b, r in zip(gbs[name, m, "int8"], gbs[name, m, "int8 rows"]))
            print(f"| {name} {n}x{k} | {m} | {copy:.1f} | {read:.1f} | {cells['int8']} | {cells['int8 rows']} | "
                  f"{ratio:.2f}x | {cells['int4']} |", flush=True)


if __name__ == "__main__":
    main()
