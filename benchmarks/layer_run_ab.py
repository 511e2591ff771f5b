"""Decode with the last layers in one native call (models/decode_layers.py) against the same layers' blocks called
one by one, in one process over one loaded model: batch-B decode steps in short spans that alternate between the
two (the run switched off by replacing `deepseek.layer_run`), so that the machine's bandwidth swings move both
alike. Prints each side's median step time over its spans and their ratio, and how many layers the run covers.

Run: `PYTHONPATH=$PWD .venv/bin/python benchmarks/layer_run_ab.py --model /tmp/latentserve-v3shape-4l-gguf/
model-Q4_K_M.gguf [--batch 1] [--context 512] [--spans 40] [--steps 8]`.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a GGUF file or checkpoint directory")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--spans", type=int, default=40, help="spans of each side, alternating")
    parser.add_argument("--steps", type=int, default=8, help="decode steps a span")
    args = parser.parse_args()

    from latentserve import LLM, SamplingParams
    from latentserve.models import deepseek

    steps = 2 * args.spans * args.steps + 4
    llm = LLM(model=args.model, num_kv_blocks=args.batch * (-(-(args.context + steps) // 16) + 1), block_size=16,
              max_model_len=args.context + steps + 16, max_num_seqs=args.batch, enable_prefix_caching=False,
              max_num_batched_tokens=args.context + 8)
    engine = llm.engine
    for b in range(args.batch):
        prompt = [(13 * i + 101 * b) % 100000 + 5 for i in range(args.context)]
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    engine.step()
    layer_run, one_by_one = deepseek.layer_run, lambda *a: None
    times: dict[str, list[float]] = {"run": [], "one by one": []}
    for span in range(2 * args.spans):
        side = ("run", "one by one")[span % 2]
        deepseek.layer_run = layer_run if side == "run" else one_by_one
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        times[side].append((time.perf_counter() - start) / args.steps)
    deepseek.layer_run = layer_run
    run = engine.model.model.run_view._entry
    layers = len(engine.model.model.layers)
    stack = None if run is None or run[3] is None else run[3].one if args.batch == 1 else run[3].many
    covered = 0 if stack is None else layers - stack.first
    med = {side: statistics.median(t) * 1e3 for side, t in times.items()}
    ratios = [b / a for a, b in zip(times["run"], times["one by one"])]
    print(f"{Path(args.model).name}: batch {args.batch}, context {args.context}, the run covering {covered} of "
          f"{layers} layers; median ms a step: run {med['run']:.2f}, one by one {med['one by one']:.2f}; "
          f"one-by-one / run per span pair: median {statistics.median(ratios):.3f} "
          f"(quartiles {statistics.quantiles(ratios, n=4)[0]:.3f}-{statistics.quantiles(ratios, n=4)[2]:.3f})")


if __name__ == "__main__":
    main()
