"""Routed experts of one MoE layer at decode batches: today's per-expert loop against the stacked `torch._grouped_mm`
path (fp32, bf16), and for int8 / int4 experts the loop with gate and up as two kernels or one fused one.

Each call routes the tokens to fresh random experts (drawn up front), so the weights come from memory as in a real
step, not from cache. Times are the best over repeats, all variants interleaved; ratios are against the loop.

    python -m benchmarks.moe                       # V2-Lite-like and V3-like layers, every format, batch 1 8 32
    python -m benchmarks.moe --shapes small --formats bf16 --batches 1 8
"""
from __future__ import annotations

import argparse
import os
import time
from typing import Callable

import torch
import torch.nn.functional as F

from latentserve.engine.cpu_malloc import keep_freed_memory
from latentserve.layers.moe import MoE, RoutingConfig
from latentserve.layers.quant.config import QuantConfig
from latentserve.kernels.cpu import cpu_features
from latentserve.layers.quant.linear import quantize_linear

# (hidden, routed experts, top-k, moe_intermediate): V3 itself has hidden 7168, too big for a small machine.
SHAPES = {
    "v2-lite": (2048, 64, 6, 1408),
    "v3-like": (2048, 256, 8, 512),
    "small": (512, 16, 4, 256),
}
FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": QuantConfig("int8"), "int4": QuantConfig("int4", 128)}

Variant = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def build_moe(hidden: int, experts: int, top_k: int, inter: int, dtype: torch.dtype) -> MoE:
    with torch.device("meta"):
        moe = MoE(hidden, inter, RoutingConfig(experts, top_k), n_shared_experts=0)
    moe.to_empty(device="cpu")
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.02)
    return moe.to(dtype)


def quantize_experts(moe: MoE, config: QuantConfig) -> list:
    """Quantize each expert in place (gate, up, down, as the loader does); returns each expert's gate and up fused
    into one quantized layer, beside its quantized down."""
    fused = []
    for e, expert in enumerate(moe.experts):
        gate_up = torch.cat([expert.gate_proj.weight, expert.up_proj.weight]).detach()
        fused.append(quantize_linear(f"experts.{e}.gate_up_proj", gate_up, None, config, "cpu"))
        for name in ("gate_proj", "up_proj", "down_proj"):
            weight = getattr(expert, name).weight.detach()
            setattr(expert, name, quantize_linear(f"experts.{e}.{name}", weight, None, config, "cpu"))
    return fused


def fused_loop(moe: MoE, gate_ups: list) -> Variant:
    """The per-expert loop with one kernel for gate and up."""
    def run(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        flat_ids = ids.flatten()
        order = torch.argsort(flat_ids, stable=True)
        tokens = order // ids.shape[1]
        pair_weights = weights.flatten().index_select(0, order)[:, None]
        start = 0
        for e, count in enumerate(torch.bincount(flat_ids, minlength=len(gate_ups)).tolist()):
            if count:
                rows = tokens[start:start + count]
                gate, up = gate_ups[e](x.index_select(0, rows)).chunk(2, dim=-1)
                y = moe.experts[e].down_proj(F.silu(gate) * up) * pair_weights[start:start + count]
                out.index_add_(0, rows, y.to(x.dtype))
                start += count
        return out
    return run


def variants(shape: tuple[int, int, int, int], fmt: str) -> tuple[MoE, dict[str, Variant]]:
    hidden, experts, top_k, inter = shape
    kind = FORMATS[fmt]
    moe = build_moe(hidden, experts, top_k, inter, kind if isinstance(kind, torch.dtype) else torch.float32)
    if isinstance(kind, QuantConfig):
        gate_ups = quantize_experts(moe, kind)
        return moe, {"loop (gate, up, down)": moe.run_experts, "loop, gate_up fused": fused_loop(moe, gate_ups)}
    moe.stack_experts()
    return moe, {"loop (gate, up, down)": moe._run_expert_loop, "stacked _grouped_mm": moe.run_experts}


def time_variants(fns: dict[str, Variant], calls: list[tuple], repeats: int) -> dict[str, float]:
    best = dict.fromkeys(fns, float("inf"))
    with torch.no_grad():
        for fn in fns.values():  # warm-up
            fn(*calls[0])
        for _ in range(repeats):
            for name, fn in fns.items():
                for args in calls:
                    start = time.perf_counter()
                    fn(*args)
                    best[name] = min(best[name], time.perf_counter() - start)
    return best


def routed_calls(hidden: int, experts: int, top_k: int, batch: int, dtype: torch.dtype, n: int) -> list[tuple]:
    g = torch.Generator().manual_seed(batch)
    calls = []
    for _ in range(n):
        x = torch.randn(batch, hidden, generator=g).to(dtype)
        weights, ids = torch.rand(batch, experts, generator=g).softmax(-1).topk(top_k, dim=-1)
        calls.append((x, weights, ids))
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=["v2-lite", "v3-like"])
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--routings", type=int, default=3, help="random routings per batch, each timed")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()  # as the engine does: a call's buffers reuse the previous call's pages
    print(f"CPU: {cpu_features().describe()}; {torch.get_num_threads()} threads; torch {torch.__version__}; "
          f"load {os.getloadavg()[0]:.2f}")
    print("| layer | format | batch | variant | ms | vs loop |")
    print("|---|---|---|---|---|---|")
    for shape_name in args.shapes:
        hidden, experts, top_k, inter = SHAPES[shape_name]
        for fmt in args.formats:
            moe, fns = variants(SHAPES[shape_name], fmt)
            dtype = FORMATS[fmt] if isinstance(FORMATS[fmt], torch.dtype) else torch.float32
            for batch in args.batches:
                calls = routed_calls(hidden, experts, top_k, batch, dtype, args.routings)
                times = time_variants(fns, calls, args.repeats)
                base = next(iter(times.values()))
                for name, t in times.items():
                    print(f"| {shape_name} | {fmt} | {batch} | {name} | {t * 1e3:.2f} | {base / t:.2f}x |",
                          flush=True)
            del moe, fns


if __name__ == "__main__":
    main()
