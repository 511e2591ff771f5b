"""int4's few-row calls in two source trees, taking turns: `ls_int4_linear` at 1 and 4 rows (2816 x 2048, group 32,
24 copies of the weight so that it streams from memory) and `ls_experts` at one token (32 int4 experts of 1408, group
32, top 6, plus a shared pair of twice the width). One worker process per tree; each round times every case in A's
worker, then in B's (the order alternating), the fastest of 3 passes, by the process's CPU time (on a loaded machine
the wall clock mostly measures the other processes; run with OMP_WAIT_POLICY=passive so that waiting threads do not
count). Prints each round's µs and A / B (B's speed-up) per case, and their medians.

    OMP_WAIT_POLICY=passive python benchmarks/int4_pairs_ab.py --a /path/to/old/tree --b . --threads 2
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

CASES = ("linear, 1 row", "linear, 4 rows", "experts, 1 token")


def _worker(threads: int) -> None:
    import torch

    from latentserve.kernels import native
    from latentserve.kernels.cpu import cpu_features
    from latentserve.layers.quant.int4 import quantize_int4

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    k = native.native_kernels(cpu_features())[0]
    n, hidden, group, inter, experts = 2816, 2048, 32, 1408, 32

    def packed(rows: int, cols: int) -> torch.Tensor:
        return native.pack_int4(*quantize_int4(torch.randn(rows, cols) * 0.02, group))

    gate_up, down = packed(n, hidden), packed(hidden, inter)
    copies = [gate_up.clone() for _ in range(24)]
    fmt = ((4, group), (4, group))
    routed = native.expert_table([(gate_up.clone(), down.clone()) for _ in range(experts)], hidden, inter, fmt)
    shared = native.expert_table([(packed(4 * inter, hidden), packed(hidden, 2 * inter))], hidden, 2 * inter, fmt)
    xs = {m: torch.randn(m, hidden) for m in (1, 4)}
    ids, weights = [torch.randperm(experts)[:6][None] for _ in range(16)], torch.rand(1, 6)

    def fastest(calls: list) -> float:
        best = float("inf")
        for _ in range(3):
            start = time.process_time()
            for call in calls:
                call()
            best = min(best, (time.process_time() - start) / len(calls))
        return best * 1e6

    print("ready", flush=True)
    for _ in sys.stdin:
        times = [fastest([lambda c=c, m=m: native.int4_linear(k, xs[m], c, group, n) for c in copies]) for m in (1, 4)]
        times.append(fastest([lambda i=i: native.experts(k, xs[1], routed, i, weights, shared) for i in ids]))
        print(" ".join(f"{t:.1f}" for t in times), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", help="the baseline tree")
    parser.add_argument("--b", help="the tree to compare")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(args.threads)
    if not (args.a and args.b):
        parser.error("--a and --b (two source trees) are required")
    workers = {}
    for name, tree in (("a", args.a), ("b", args.b)):
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--threads", str(args.threads)]
        workers[name] = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": os.path.abspath(tree)}, cwd=tree,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if workers[name].stdout.readline().strip() != "ready":
            sys.exit(f"the worker of {tree} did not start")
    got: dict[str, list[list[float]]] = {"a": [], "b": []}
    for r in range(args.rounds):
        for name in ("a", "b") if r % 2 == 0 else ("b", "a"):
            workers[name].stdin.write("go\n")
            workers[name].stdin.flush()
            got[name].append([float(v) for v in workers[name].stdout.readline().split()])
        print(f"round {r + 1}: a {got['a'][-1]} b {got['b'][-1]} µs", flush=True)
    for i, case in enumerate(CASES):
        ratios = [a[i] / b[i] for a, b in zip(got["a"], got["b"])]
        print(f"{case}: a / b per round {' '.join(f'{x:.2f}' for x in ratios)}; median {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
