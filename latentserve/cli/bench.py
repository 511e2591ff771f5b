"""`latentserve bench`: offline throughput and latency on random prompts, timed per request from engine steps."""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from latentserve.cli.args import (
    CLIError,
    HelpFormatter,
    add_engine_args,
    build_llm,
    positive_int,
    user_errors,
    write,
)
from latentserve.cli.step_profile import (
    StepBreakdown, categorize, format_breakdown, instrumented, new_profiler, seconds_per_step, step_range,
)
from latentserve.cli.streaming import check_finished
from latentserve.sampling_params import SamplingParams


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="offline throughput and latency benchmark",
                              description=__doc__.split(":", 1)[1].strip(),
                              formatter_class=HelpFormatter)
    p.add_argument("--num-prompts", type=positive_int, default=16, help="requests, all submitted at once")
    p.add_argument("--input-len", type=positive_int, default=64, help="prompt tokens per request")
    p.add_argument("--output-len", type=positive_int, default=32, help="generated tokens per request (EOS ignored)")
    p.add_argument("--output-json", type=Path, default=None, help="also write the results to this JSON file")
    p.add_argument("--profile", action="store_true",
                   help="then run requests of the same shape under torch.profiler and print where a step's time goes "
                        "(weight GEMMs, attention, MoE routing, other ops, Python)")
    add_engine_args(p)
    p.set_defaults(func=run)


class ProgressBar:
    """`[#####-----] 5/10 requests` on stderr, redrawn in place."""

    def __init__(self, total: int, width: int = 30) -> None:
        self.total, self.width, self.done = total, width, 0
        self._draw()

    def advance(self) -> None:
        self.done += 1
        self._draw()

    def close(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()

    def _draw(self) -> None:
        filled = self.width * self.done // self.total
        sys.stderr.write(f"\r[{'#' * filled}{'-' * (self.width - filled)}] {self.done}/{self.total} requests")
        sys.stderr.flush()


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def latency_stats_ms(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return dict(mean=1000 * sum(values) / len(values), p50=1000 * percentile(values, 50),
                p99=1000 * percentile(values, 99))


def run(args: argparse.Namespace) -> int:
    if args.output_json is not None and not args.output_json.parent.is_dir():
        raise CLIError(f"cannot write {args.output_json}: directory {args.output_json.parent} does not exist")
    llm = build_llm(args)
    engine = llm.engine
    if args.input_len + args.output_len > engine.max_model_len:
        raise CLIError(f"--input-len {args.input_len} + --output-len {args.output_len} exceeds "
                       f"max_model_len={engine.max_model_len}")
    if args.profile and not hasattr(engine, "runner"):
        raise CLIError("--profile needs the model in this process: drop --data-parallel-size")
    generator = torch.Generator().manual_seed(args.seed)
    vocab_size = engine.model.config.vocab_size
    prompts = torch.randint(0, vocab_size, (args.num_prompts, args.input_len), generator=generator).tolist()
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    with user_errors():
        requests = [engine.make_request(prompt, params) for prompt in prompts]
    # Seconds from the start at which each request's output tokens came back.
    token_times: dict[str, list[float]] = {r.request_id: [] for r in requests}
    step_times: dict[str, list[float]] = {"decode": [], "prefill": []}
    bar = ProgressBar(len(requests))
    start = time.perf_counter()
    for request in requests:
        engine.scheduler.add_request(request)
    while engine.has_unfinished_requests():
        kind = step_kind(engine) if args.profile else "decode"
        step_start = time.perf_counter()
        outputs = engine.step()
        step_times[kind].append(time.perf_counter() - step_start)
        now = time.perf_counter() - start
        for output in outputs:
            times = token_times[output.request_id]
            times.extend([now] * (len(output.outputs[0].token_ids) - len(times)))
            if output.finished:
                check_finished(output)
                bar.advance()
    total_time = time.perf_counter() - start
    bar.close()

    results = summarize(args, total_time, list(token_times.values()))
    results["model"] = str(llm.model_dir)
    write(format_table(results))
    if args.profile:
        median_times = {kind: percentile(t, 50) for kind, t in step_times.items() if t}
        # Fresh prompts of the same shape: the first ones would now hit the prefix cache.
        fresh = torch.randint(0, vocab_size, (args.num_prompts, args.input_len), generator=generator).tolist()
        breakdowns = profile_run(engine, fresh, params)
        results["profile_ms_per_step"] = {
            kind: {c: 1e3 * s for c, s in seconds_per_step(b).items()} for kind, b in breakdowns.items()
        }
        write("\nwhere a step's time goes (requests of the same shape, run again under torch.profiler):\n")
        write(format_breakdown(breakdowns, median_times))
    if args.output_json is not None:
        with user_errors():
            args.output_json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def step_kind(engine) -> str:
    """"decode" when every request is past its prompt and none waits, else "prefill"."""
    requests = engine.scheduler.requests.values()
    decoding = not engine.scheduler.waiting and all(r.num_computed_tokens >= r.num_prompt_tokens for r in requests)
    return "decode" if decoding else "prefill"


def profile_run(engine, prompts: list[list[int]], params: SamplingParams) -> dict[str, StepBreakdown]:
    """Run `prompts` to the end under the profiler, each step in a range named by its kind."""
    for prompt in prompts:
        engine.scheduler.add_request(engine.make_request(prompt, params))
    with instrumented(engine), new_profiler() as prof:
        while engine.has_unfinished_requests():
            with step_range(step_kind(engine)):
                engine.step()
    return categorize(prof.events())


def summarize(args: argparse.Namespace, total_time: float, token_times: list[list[float]]) -> dict:
    num_output_tokens = sum(len(times) for times in token_times)
    num_input_tokens = args.input_len * len(token_times)
    ttft = [times[0] for times in token_times if times]
    itl = [b - a for times in token_times for a, b in zip(times, times[1:])]
    return dict(
        num_prompts=len(token_times), input_len=args.input_len, output_len=args.output_len,
        enable_dbo=args.enable_dbo, dtype=args.dtype, seed=args.seed,
        total_time_s=total_time, num_input_tokens=num_input_tokens, num_output_tokens=num_output_tokens,
        requests_per_s=len(token_times) / total_time, input_tokens_per_s=num_input_tokens / total_time,
        output_tokens_per_s=num_output_tokens / total_time,
        ttft_ms=latency_stats_ms(ttft), itl_ms=latency_stats_ms(itl),
    )


def format_table(r: dict) -> str:
    rows = [
        ("requests", f"{r['num_prompts']} x ({r['input_len']} in, {r['output_len']} out)"),
        ("total time (s)", f"{r['total_time_s']:.3f}"),
        ("requests/s", f"{r['requests_per_s']:.2f}"),
        ("input tokens/s", f"{r['input_tokens_per_s']:.1f}"),
        ("output tokens/s", f"{r['output_tokens_per_s']:.1f}"),
    ]
    for label, key in (("time to first token (ms)", "ttft_ms"), ("inter-token latency (ms)", "itl_ms")):
        stats = r[key]
        rows.append((label, "n/a" if stats is None else
                     f"mean {stats['mean']:.2f}  p50 {stats['p50']:.2f}  p99 {stats['p99']:.2f}"))
    width = max(len(label) for label, _ in rows)
    return "".join(f"{label:<{width}}  {value}\n" for label, value in rows)
