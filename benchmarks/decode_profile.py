"""Where a decode step's time goes on a GGUF file loaded by latentserve: batch 1, 8 and 32, int8 (Q8_0) and int4
(Q4_K_M), on benchmarks/llama_cpp_ik.py's V3-shaped checkpoint.

Each part of `LLMEngine.step()` is timed by `time.perf_counter` around the call that does it (no profiler: its
per-op cost would bury the Python it is asked to find): the attention blocks (the one-call native block, or the
modules where it does not apply), the MoE / MLP blocks (likewise), the layer run (the last layers' blocks in one
call, models/decode_layers.py), lm_head (`compute_logits`), sampling (the
sampling metadata and the sampler), metadata (the persistent input buffers and the attention metadata builder), the
scheduler (`schedule` and `update`), embedding + rotary angles + final norm, and the rest of the step (the runner's
and the engine's Python glue, the request outputs). Batch B: B requests of `--context` distinct tokens each are
prefilled, then `--steps` decode steps are timed; `--rounds` rounds, the fastest round's breakdown counts. Each
part is also timed in the stepping thread's CPU time. After each batch-1 round: its weight bandwidth (bytes of weights
per token, benchmarks/decode_bytes.py, over the step time) against the copy bandwidth measured right after it
(benchmarks/common.py's `copy_bandwidth`).

Run: `PYTHONPATH=$PWD .venv/bin/python benchmarks/decode_profile.py --gguf-dir /tmp/latentserve-v3shape-4l-gguf
[--formats int8,int4] [--batches 1,8,32] [--rounds 3] [--threads 2]`.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import batch_sizes, copy_bandwidth  # noqa: E402
from benchmarks.decode_bytes import decode_bytes_per_token  # noqa: E402
from benchmarks.llama_cpp import load_average  # noqa: E402

FILES = {"int8": "model-Q8_0.gguf", "int4": "model-Q4_K_M.gguf"}
PARTS = ("attention blocks", "MoE / MLP blocks", "layer run", "lm_head", "sampling", "metadata", "scheduler",
         "embed + rope + final norm", "rest")


class Timers:
    """Seconds per part, summed over the timed calls: wall time, and the calling thread's CPU time (which leaves out
    the time the process waits descheduled on a loaded machine; the kernels' other threads are not in it)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu_seconds: dict[str, float] = defaultdict(float)

    def timed(self, fn: Callable, part: str) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start
                self.cpu_seconds[part] += time.thread_time() - cpu

        return wrapper


def _targets(engine) -> list[tuple[object, str, str]]:
    """(object, attribute, part) of every call timed."""
    from latentserve.engine import model_runner
    from latentserve.models import deepseek

    runner, model = engine.runner, engine.runner.model
    out = [(deepseek, "fused_attention", "attention blocks"), (deepseek, "attend", "attention blocks"),
           (deepseek, "fused_moe", "MoE / MLP blocks"), (deepseek, "run_layers", "layer run"),
           (model, "compute_logits", "lm_head"),
           (model_runner, "SamplingMetadata", "sampling"), (runner, "sampler", "sampling"),
           (runner.input_buffers, "prepare", "metadata"), (engine.scheduler, "schedule", "scheduler"),
           (engine.scheduler, "update", "scheduler"), (model.model.embed_tokens, "forward", "embed + rope + final norm"),
           (model.model.norm, "forward", "embed + rope + final norm")]
    out += [(builder, "build", "metadata") for builder in runner.builders]
    out += [(layer.mlp, "forward", "MoE / MLP blocks") for layer in model.model.layers]
    out += [(rotary, "cos_sin", "embed + rope + final norm") for rotary in model.model.rotary_embs]
    return out


class _TimedMetadata:
    """`SamplingMetadata` as the runner sees it, its `from_requests` timed."""

    def __init__(self, cls, timers: Timers) -> None:
        self.from_requests = timers.timed(cls.from_requests, "sampling")


@contextlib.contextmanager
def instrumented(engine, timers: Timers) -> Iterator[None]:
    """Every target timed for the duration, then put back as it was."""
    saved = []
    for obj, attr, part in _targets(engine):
        own = attr in vars(obj)  # an instance attribute (or a module's name) to restore; else the class's shows again
        original = getattr(obj, attr)
        saved.append((obj, attr, own, original))
        if attr == "SamplingMetadata":
            setattr(obj, attr, _TimedMetadata(original, timers))
        else:
            setattr(obj, attr, timers.timed(original, part))
    try:
        yield
    finally:
        for obj, attr, own, original in reversed(saved):
            if own:
                setattr(obj, attr, original)
            else:
                delattr(obj, attr)


Measured = tuple[float, dict[str, float], dict[str, float]]  # step seconds, {part: wall seconds}, {part: CPU seconds}


def decode_round(engine, batch: int, context: int, steps: int) -> Measured:
    """(seconds per decode step, {part: seconds per step}, {part: the stepping thread's CPU seconds per step}) of
    `steps` steps of `batch` requests after `context` tokens each."""
    from latentserve import SamplingParams

    for b in range(batch):
        prompt = [(13 * i + 101 * b) % 100000 + 5 for i in range(context)]
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    engine.step()  # every request decoding
    timers = Timers()
    with instrumented(engine, timers):
        start, cpu_start = time.perf_counter(), time.thread_time()
        for _ in range(steps):
            engine.step()
        wall, cpu = time.perf_counter() - start, time.thread_time() - cpu_start
    while engine.has_unfinished_requests():
        engine.step()
    per_step = []
    for total, seconds in ((wall, timers.seconds), (cpu, timers.cpu_seconds)):
        parts = {part: seconds[part] / steps for part in PARTS[:-1]}
        parts["rest"] = total / steps - sum(parts.values())
        per_step.append(parts)
    return wall / steps, per_step[0], per_step[1]


def profile(gguf: Path, args: argparse.Namespace) -> tuple[dict[int, Measured], list[str]]:
    """({batch: the fastest round's measurement}, each round's batch-1 weight bandwidth against the copy bandwidth
    measured right after it)."""
    from latentserve import LLM

    tokens = max(args.batches) * (args.context + args.steps + 16)
    llm = LLM(model=str(gguf), num_kv_blocks=-(-tokens // 16) + max(args.batches), block_size=16,
              max_model_len=args.context + args.steps + 16, max_num_seqs=max(args.batches),
              enable_prefix_caching=False, max_num_batched_tokens=args.context + 8)
    per_token = sum(decode_bytes_per_token(llm.engine.model).values())
    decode_round(llm.engine, 1, 16, 2)  # first-call costs
    best: dict[int, Measured] = {}
    bandwidth = []
    for _ in range(args.rounds):
        for batch in args.batches:
            measured = decode_round(llm.engine, batch, args.context, args.steps)
            if batch == 1:
                weights, copy = per_token / measured[0] / 1e9, copy_bandwidth() / 1e9
                bandwidth.append(f"{weights:.1f} / {copy:.1f} GB/s = {weights / copy:.0%}")
            if batch not in best or measured[0] < best[batch][0]:
                best[batch] = measured
    print(f"{gguf.name}: {per_token / 1e6:.1f} MB of weights per batch-1 token; its weight bandwidth against the copy "
          f"bandwidth, per round: {'; '.join(bandwidth)}", flush=True)
    return best


def report(name: str, best: dict[int, Measured]) -> None:
    """Per batch: wall ms per part (share of the step), then the stepping thread's CPU ms of the parts that are not
    kernels (on a loaded machine, the wall time of a short Python part is mostly the time it waited)."""
    print(f"\n{name}: wall ms per decode step (share of the step)\n\n| batch | step | tok/s | "
          + " | ".join(PARTS) + " |\n|" + "---|" * (len(PARTS) + 3))
    for batch, (step, parts, _) in sorted(best.items()):
        cells = " | ".join(f"{parts[p] * 1e3:.3f} ({parts[p] / step:.0%})" for p in PARTS)
        print(f"| {batch} | {step * 1e3:.2f} | {batch / step:.1f} | {cells} |")
    print(f"\n{name}: the stepping thread's CPU ms per decode step\n\n| batch | " + " | ".join(PARTS)
          + " |\n|" + "---|" * (len(PARTS) + 1))
    for batch, (_, _, cpu) in sorted(best.items()):
        print(f"| {batch} | " + " | ".join(f"{cpu[p] * 1e3:.3f}" for p in PARTS) + " |", flush=True)


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf-dir", type=Path, required=True, help=f"holds {', '.join(FILES.values())}")
    parser.add_argument("--formats", default="int8,int4", help=f"from {', '.join(FILES)}")
    parser.add_argument("--batches", default="1,8,32", help="decode batch sizes (comma-separated)")
    parser.add_argument("--context", type=int, default=512, help="each request's prompt")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    names = args.formats.split(",")
    if any(n not in FILES for n in names):
        parser.error(f"--formats {args.formats!r}: each must be one of {list(FILES)}")
    args.batches = batch_sizes(parser, args.batches, 1)
    missing = [str(args.gguf_dir / FILES[n]) for n in names if not (args.gguf_dir / FILES[n]).is_file()]
    if missing:
        parser.error(f"--gguf-dir: missing {', '.join(missing)} (benchmarks/llama_cpp_ik.py writes them)")
    torch.set_num_threads(args.threads)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {args.threads} threads; context {args.context}; "
          f"{args.steps} steps x {args.rounds} rounds; load average {load_average()}", flush=True)
    for name in names:
        report(name, profile(args.gguf_dir / FILES[name], args))
    print(f"\nload average after: {load_average()}")


if __name__ == "__main__":
    main()
