"""A decode step's one-call MoE block (router, routing, routed and shared experts: `models/moe_block.fused_moe`;
where it does not take the tokens, the MoE module's forward) in two source trees, interleaved: per format, one
worker process per tree (both import `latentserve`) builds the layer once, then each round times every case in A's
worker, then in B's (the fastest of `--calls` calls), so that the machine's noise moves both alike; the ratio B / A
per round, then their median. A
V2-Lite-shaped layer (hidden 2048, 64 experts of 1408, top 6, 2 shared) by default, 16 different inputs in turn, so
that the chosen experts' weights come from memory as in a real step. fp32 and bf16 also time the stacked experts'
torch path (`--torch-tokens`, `MoE.run_experts`, no shared experts).

    python benchmarks/experts_ab.py --a /path/to/main --b . --rounds 5 --threads 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CASES = ("fp32:1,4", "bf16:1,4", "int8:1,8", "int4:1,8")


def _worker(fmt: str, token_counts: list[int], torch_tokens: int, calls: int, hidden: int, experts: int, top_k: int,
            inter: int) -> None:
    """Builds the layer in the tree on sys.path, then per line on stdin prints the fastest of `calls` calls of each
    case in µs (the block at each token count, the torch path)."""
    import torch
    from torch import nn

    from latentserve.kernels.policy import default_policy
    from latentserve.layers.mlp import GatedMLP
    from latentserve.layers.moe import MoE, RoutingConfig
    from latentserve.layers.quant.config import QuantConfig
    from latentserve.layers.quant.linear import quantize_linear
    from latentserve.models.moe_block import fused_moe
    from latentserve.models.native_view import NativeView

    dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    with torch.device("meta"):
        moe = MoE(hidden, inter, RoutingConfig(experts, top_k), n_shared_experts=2)
    moe.to_empty(device="cpu")
    source = torch.empty(2 * hidden * inter).uniform_(-0.03, 0.03)  # drawn once: filling 2 GB at random takes long
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(source[: p.numel()].view_as(p) if p.numel() <= source.numel() else torch.randn_like(p) * 0.03)
    moe.to(dtype)
    moe.gate.float()  # the router stays fp32, as the loader keeps it
    if fmt in ("int8", "int4"):
        config = QuantConfig(fmt, 128 if fmt == "int4" else None)
        for i, mlp in enumerate([*moe.experts, moe.shared_experts]):
            gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()
            mlp.fuse_gate_up(quantize_linear(f"{i}.gate_up_proj", gate_up, None, config, "cpu"))
            mlp.down_proj = quantize_linear(f"{i}.down_proj", mlp.down_proj.weight.detach(), None, config, "cpu")
    else:
        moe.stack_experts()
    policy = default_policy()
    for module in moe.modules():
        if isinstance(module, nn.Module) and hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading(policy)
    assert isinstance(moe.shared_experts, GatedMLP)
    view, g, cases = NativeView(), torch.Generator().manual_seed(0), {}

    def best(fn, inputs: list) -> float:  # the fastest call: other sessions' load stalls OpenMP's barriers for ms
        times = []
        for i in range(calls):
            start = time.perf_counter()
            fn(*inputs[i % len(inputs)])
            times.append(time.perf_counter() - start)
        return min(times) * 1e6

    for tokens in token_counts:
        inputs = [((torch.randn(tokens, hidden, generator=g) * 3).to(dtype), torch.zeros(tokens, hidden, dtype=dtype))
                  for _ in range(16)]
        with torch.no_grad():  # past the block's tokens (its router's kernel: 3 rows), the modules: MoE.forward
            fused = fused_moe(moe, view, *inputs[0]) is not None
        step = (lambda x, h: fused_moe(moe, view, x, h)) if fused else (lambda x, h: moe(x))
        cases[f"{fmt} {'block' if fused else 'modules'}, {tokens} tokens"] = (step, inputs)
    if torch_tokens and moe.stacked is not None:
        inputs = []
        for _ in range(16):
            weights, ids = torch.rand(torch_tokens, experts, generator=g).softmax(-1).topk(top_k, dim=-1)
            inputs.append(((torch.randn(torch_tokens, hidden, generator=g) * 3).to(dtype), weights, ids))
        cases[f"{fmt} run_experts, {torch_tokens} tokens"] = (moe.run_experts, inputs)
    print("ready", flush=True)
    for _ in sys.stdin:  # one line a round: every case timed, one JSON line back
        with torch.no_grad():
            print(json.dumps({name: best(fn, inputs) for name, (fn, inputs) in cases.items()}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", required=True, help="tree A (the baseline)")
    parser.add_argument("--b", required=True, help="tree B")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--torch-tokens", type=int, default=32)
    parser.add_argument("--cases", default=";".join(CASES), help="format:token counts, separated by ';'")
    parser.add_argument("--shape", default="2048,64,6,1408", help="hidden,experts,top_k,inter")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = tuple(int(v) for v in args.shape.split(","))
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        fmt, tokens = args.child.split(":")
        _worker(fmt, [int(t) for t in tokens.split(",")], args.torch_tokens, args.calls, *shape)
        return
    times: dict[str, dict[str, list[float]]] = {}
    for case in args.cases.split(";"):
        workers = {}
        for side in ("a", "b"):  # one at a time: each holds a whole layer's weights
            tree = os.path.abspath(getattr(args, side))
            workers[side] = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--a", tree, "--b", tree, "--child", case, "--calls",
                 str(args.calls), "--threads", str(args.threads), "--shape", args.shape, "--torch-tokens",
                 str(args.torch_tokens)], cwd=tree, env={**os.environ, "PYTHONPATH": tree}, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, text=True)
            if workers[side].stdout.readline().strip() != "ready":
                sys.exit(f"{tree} {case}: the worker failed")
        for r in range(args.rounds):
            for side, worker in workers.items():
                worker.stdin.write("go\n")
                worker.stdin.flush()
                for name, us in json.loads(worker.stdout.readline()).items():
                    times.setdefault(name, {"a": [], "b": []})[side].append(us)
            print(f"{case}: round {r + 1}: " + ", ".join(f"{n} {t['b'][-1] / t['a'][-1]:.2f}" for n, t in times.items()
                                                          if len(t["b"]) == r + 1), file=sys.stderr, flush=True)
        for worker in workers.values():
            worker.stdin.close()
            worker.wait()
    print(f"| case ({args.threads} threads) | A µs | B µs | B / A per round | median |\n|---|---|---|---|---|")
    for case, t in times.items():
        ratios = [b / a for a, b in zip(t["a"], t["b"])]
        print(f"| {case} | {statistics.median(t['a']):.0f} | {statistics.median(t['b']):.0f} | "
              f"{' '.join(f'{x:.2f}' for x in ratios)} | {statistics.median(ratios):.2f} |")


if __name__ == "__main__":
    main()
