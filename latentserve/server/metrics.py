"""Server metrics in the Prometheus text exposition format (vLLM's metric names, written by hand)."""
from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field
from typing import Callable

PREFIX = "latentserve"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(init=False)  # per bucket, not cumulative; the last one is +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def render(self, name: str) -> list[str]:
        lines, cumulative = [], 0
        for bound, n in zip((*map(repr, self.buckets), "+Inf"), self.counts):
            cumulative += n
            lines.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
        return lines + [f"{name}_sum {self.total}", f"{name}_count {self.count}"]


class Metrics:
    """Counters and histograms the engine thread records; gauges read live from the scheduler when scraped."""

    def __init__(self, gauges: Callable[[], dict[str, float]]) -> None:
        self._lock = threading.Lock()
        self._gauges = gauges
        self.finished: dict[str, int] = {}  # finish reason -> requests
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)

    def observe_tokens(self, num_new: int, first: bool, seconds: float) -> None:
        """`num_new` tokens of one request arrived `seconds` after its arrival (first) or its previous token."""
        with self._lock:
            self.generation_tokens += num_new
            if first:
                self.ttft.observe(seconds)
            elif num_new:
                self.itl.observe(seconds / num_new)

    def observe_finished(self, finish_reason: str, num_prompt_tokens: int) -> None:
        with self._lock:
            self.finished[finish_reason] = self.finished.get(finish_reason, 0) + 1
            self.prompt_tokens += num_prompt_tokens

    def render(self) -> str:
        p = PREFIX
        with self._lock:
            lines = [f"# HELP {p}:request_success_total Finished requests by finish reason.",
                     f"# TYPE {p}:request_success_total counter"]
            for reason in ("stop", "length", "abort", "error"):
                lines.append(f'{p}:request_success_total{{finished_reason="{reason}"}} {self.finished.get(reason, 0)}')
            lines += [f"# HELP {p}:prompt_tokens_total Prompt tokens of finished requests.",
                      f"# TYPE {p}:prompt_tokens_total counter", f"{p}:prompt_tokens_total {self.prompt_tokens}",
                      f"# HELP {p}:generation_tokens_total Generated tokens.",
                      f"# TYPE {p}:generation_tokens_total counter",
                      f"{p}:generation_tokens_total {self.generation_tokens}"]
            lines += [f"# HELP {p}:time_to_first_token_seconds Time from arrival to the first token.",
                      f"# TYPE {p}:time_to_first_token_seconds histogram",
                      *self.ttft.render(f"{p}:time_to_first_token_seconds"),
                      f"# HELP {p}:inter_token_latency_seconds Time between two tokens of a request.",
                      f"# TYPE {p}:inter_token_latency_seconds histogram",
                      *self.itl.render(f"{p}:inter_token_latency_seconds")]
        for name, (help_text, value) in self._gauge_lines().items():
            lines += [f"# HELP {p}:{name} {help_text}", f"# TYPE {p}:{name} gauge", f"{p}:{name} {value}"]
        return "\n".join(lines) + "\n"

    def _gauge_lines(self) -> dict[str, tuple[str, float]]:
        g = self._gauges()
        return {
            "num_requests_running": ("Requests in the running batch.", g["running"]),
            "num_requests_waiting": ("Requests waiting to be scheduled.", g["waiting"]),
            "kv_cache_usage_perc": ("Fraction of KV cache blocks in use (1 = full).", g["kv_cache_usage"]),
        }
