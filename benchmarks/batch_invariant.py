"""The throughput cost of batch-invariant mode: the same offline workload as `latentserve bench` (random prompts of
--input-len tokens, --output-len tokens each, EOS ignored, all submitted at once) through two engines in this
process, default and `batch_invariant=True`, in alternating rounds (fresh prompts each round, the same for both).
Reports output tok/s per round and the median of each round's ratio. `--clock cpu` (the default) times this
process's CPU time, which a shared machine disturbs far less than wall time; with one thread (`--threads 1`) the two
agree on an idle machine.
`--v2-lite-layers N` runs a random DeepSeek-V2-Lite-shaped checkpoint of N layers (written once to --dir) instead
of the embedded model.
Run: `.venv/bin/python benchmarks/batch_invariant.py [--dtype bfloat16] [--quantization int8] [--rounds 5]`.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from latentserve import LLM, SamplingParams  # noqa: E402


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def run_round(llm: LLM, prompts: list[list[int]], output_len: int, clock=time.process_time) -> float:
    """Output tokens per second of one batch of requests."""
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    start = clock()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = clock() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--clock", choices=CLOCKS, default="cpu")
    parser.add_argument("--v2-lite-layers", type=int, default=None)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/latentserve-v2-lite"))
    args = parser.parse_args()
    model = None
    if args.v2_lite_layers is not None:
        from benchmarks.weights import write_checkpoint

        model = args.dir / f"layers{args.v2_lite_layers}"
        if not (model / "config.json").is_file():
            write_checkpoint(model, args.v2_lite_layers)
    common = dict(model=model, dtype=args.dtype, quantization=args.quantization, num_threads=args.threads,
                  max_model_len=args.input_len + args.output_len, num_kv_blocks=2048)
    engines = {"default": LLM(**common), "invariant": LLM(**common, batch_invariant=True)}
    vocab = engines["default"].engine.model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    warm = torch.randint(0, vocab, (2, args.input_len), generator=generator).tolist()
    for llm in engines.values():
        run_round(llm, warm, 4)
    for r in range(args.rounds):
        prompts = torch.randint(0, vocab, (args.num_prompts, args.input_len), generator=generator).tolist()
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for name in order:
            rates[name].append(run_round(engines[name], prompts, args.output_len, CLOCKS[args.clock]))
        print(f"round {r}: " + ", ".join(f"{n} {rates[n][-1]:.1f} tok/s" for n in engines), flush=True)
    ratios = [i / d for d, i in zip(rates["default"], rates["invariant"])]
    print(f"invariant / default throughput: median {statistics.median(ratios):.3f} "
          f"(rounds {', '.join(f'{x:.3f}' for x in ratios)})")


if __name__ == "__main__":
    main()
