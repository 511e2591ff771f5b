"""A decode step's one-call MoE block (router, routing, routed and shared experts: `models/moe_block.fused_moe`) in
two source trees, interleaved: each round runs every case in tree A's process, then in tree B's (one process per tree
and case: both import `latentserve`), so the machine's noise moves both alike; the ratio B / A per round, then the
median. A V2-Lite-shaped layer (hidden 2048, 64 experts of 1408, top 6, 2 shared) by default; each call routes the
tokens to fresh experts (router weights redrawn per call would cost more than the block: the inputs are drawn
instead), so that the weights come from memory as in a real step.

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

CASES = ("fp32:1", "fp32:4", "bf16:1", "bf16:4", "int8:1", "int8:8", "int4:1", "int4:8")


def _child(fmt: str, tokens: int, calls: int, hidden: int, experts: int, top_k: int, inter: int) -> float:
    """The median µs of one fused MoE block call, in the tree on sys.path."""
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
    with torch.no_grad():
        for p in moe.parameters():
            p.uniform_(-0.03, 0.03)
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
    view = NativeView()
    g = torch.Generator().manual_seed(0)
    inputs = [(torch.randn(tokens, hidden, generator=g) * 3).to(dtype) for _ in range(16)]
    hidden_states = torch.zeros(tokens, hidden, dtype=dtype)
    if fused_moe(moe, view, inputs[0], hidden_states) is None:
        raise SystemExit(f"{fmt} at {tokens} tokens: the fused block does not run")
    times = []
    for i in range(calls):
        start = time.perf_counter()
        fused_moe(moe, view, inputs[i % len(inputs)], hidden_states)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", required=True, help="tree A (the baseline)")
    parser.add_argument("--b", required=True, help="tree B")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--shape", default="2048,64,6,1408", help="hidden,experts,top_k,inter")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = tuple(int(v) for v in args.shape.split(","))
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        fmt, tokens = args.child.split(":")
        print(json.dumps(_child(fmt, int(tokens), args.calls, *shape)))
        return
    times: dict[str, dict[str, list[float]]] = {c: {"a": [], "b": []} for c in args.cases.split(",")}
    for r in range(args.rounds):
        for case in times:
            for side in ("a", "b"):
                tree = os.path.abspath(getattr(args, side))
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "--a", tree, "--b", tree, "--child",
                                      case, "--calls", str(args.calls), "--threads", str(args.threads), "--shape",
                                      args.shape], cwd=tree, env={**os.environ, "PYTHONPATH": tree},
                                     capture_output=True, text=True, check=True)
                times[case][side].append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"round {r + 1} done", file=sys.stderr)
    print(f"| case ({args.threads} threads) | A µs | B µs | B / A per round | median |\n|---|---|---|---|---|")
    for case, t in times.items():
        ratios = [b / a for a, b in zip(t["a"], t["b"])]
        print(f"| {case} | {statistics.median(t['a']):.0f} | {statistics.median(t['b']):.0f} | "
              f"{' '.join(f'{x:.2f}' for x in ratios)} | {statistics.median(ratios):.2f} |")


if __name__ == "__main__":
    main()
