"""Batch-1 decode and prefill of one model file in two source trees, taking turns: one worker process per tree (each
imports its own `latentserve`) loads the model once, then each round runs `llama_cpp.our_round` (decode steps after
a prompt, then one prefill) in A's worker and in B's, the order alternating from round to round, so that the
machine's bandwidth swings (1.5x within minutes) move both alike. Prints each round's B / A ratio and their median:
the way to tell whether a change moved decode on this machine, where two runs minutes apart differ by 10-40 %.

    python benchmarks/decode_ab.py --a /path/to/old/tree --b . --model /tmp/latentserve-v3shape-4l-gguf/model-Q8_0.gguf

Two kernel builds of one tree: `--a . --b . --a-kernels avx2 --b-kernels avx2_vnni` (LATENTSERVE_NATIVE_KERNELS in
each worker).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys


def _worker(model: str, prefill: int, decode: int, depth: int) -> None:
    """Loads `model` with the latentserve on sys.path, then per line on stdin prints decode and prefill tok/s."""
    from benchmarks.llama_cpp import our_round
    from latentserve import LLM

    longest = max(prefill, depth) + decode + 16
    llm = LLM(model=model, num_kv_blocks=-(-longest // 16) + 1, block_size=16, max_model_len=longest, max_num_seqs=1,
              enable_prefix_caching=False, max_num_batched_tokens=max(prefill, depth))
    our_round(llm.engine, 64, 4, 8)  # first-call costs
    print("ready", flush=True)
    for _ in sys.stdin:
        r = our_round(llm.engine, prefill, decode, depth)
        print(f"{r['decode_b1_tok_s']} {r['prefill_tok_s']}", flush=True)


def _start(tree: str, kernels: str | None, args: argparse.Namespace) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    if kernels:
        env["LATENTSERVE_NATIVE_KERNELS"] = kernels
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--model", args.model, "--prefill", str(args.prefill),
           "--decode", str(args.decode), "--depth", str(args.depth)]
    proc = subprocess.Popen(cmd, env=env, cwd=tree, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() != "ready":
        sys.exit(f"the worker of {tree} did not load {args.model}")
    return proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", help="the baseline tree")
    parser.add_argument("--b", help="the tree to compare")
    parser.add_argument("--a-kernels", help="A's kernel build (LATENTSERVE_NATIVE_KERNELS), e.g. avx2")
    parser.add_argument("--b-kernels", help="B's kernel build")
    parser.add_argument("--model", required=True, help="a checkpoint folder or GGUF file both trees load")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--depth", type=int, default=512, help="prompt tokens before the decode steps")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return _worker(args.model, args.prefill, args.decode, args.depth)
    if not (args.a and args.b):
        parser.error("--a and --b (two source trees) are required")
    workers = {"a": _start(args.a, args.a_kernels, args), "b": _start(args.b, args.b_kernels, args)}
    got: dict[str, list[tuple[float, float]]] = {"a": [], "b": []}
    for r in range(args.rounds):
        for name in ("a", "b") if r % 2 == 0 else ("b", "a"):
            workers[name].stdin.write("go\n")
            workers[name].stdin.flush()
            got[name].append(tuple(map(float, workers[name].stdout.readline().split())))
        print(f"round {r + 1}: decode a {got['a'][-1][0]:.1f} b {got['b'][-1][0]:.1f} tok/s, prefill a "
              f"{got['a'][-1][1]:.0f} b {got['b'][-1][1]:.0f} tok/s", flush=True)
    for i, what in enumerate(("decode", "prefill")):
        ratios = [b[i] / a[i] for a, b in zip(got["a"], got["b"])]
        print(f"{what} b / a per round: {' '.join(f'{x:.2f}' for x in ratios)}; median {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
