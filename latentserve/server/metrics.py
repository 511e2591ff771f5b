"""Server metrics on `prometheus_client`, with vLLM's metric names and labels.

Names are `<prefix>:<vLLM's name>`: the default prefix `latentserve`, or `vllm` for the exact names vLLM exports, so
that dashboards and alerts written for vLLM work unchanged. Only the front-end process records (data-parallel ranks
hand their outputs back to it), so one process-local registry sees every request. Speculative decoding's counters are
the engine's own totals (summed over data-parallel ranks), read when scraped.
"""
from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from latentserve.engine.spec_decode.metrics import SpecDecodingStats
from latentserve.structured_params import KINDS as STRUCTURED_KINDS

PREFIX = "latentserve"
FINISH_REASONS = ("stop", "length", "abort", "error")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
N_BUCKETS = (1, 2, 5, 10, 20)


class _Gauges(Collector):
    """The scheduler's state, read when scraped."""

    def __init__(self, prefix: str, model_name: str, read: Callable[[], dict[str, float]]) -> None:
        self.prefix, self.model_name, self.read = prefix, model_name, read

    def collect(self) -> Iterator[Metric]:
        g = self.read()
        for name, help_text, key in (("num_requests_running", "Requests in the running batch.", "running"),
                                     ("num_requests_waiting", "Requests waiting to be scheduled.", "waiting"),
                                     ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).",
                                      "kv_cache_usage")):
            family = GaugeMetricFamily(f"{self.prefix}:{name}", help_text, labels=["model_name"])
            family.add_metric([self.model_name], g[key])
            yield family


class _SpecDecode(Collector):
    """vLLM's spec-decode counters from the engine's acceptance totals; absent when speculation is off."""

    def __init__(self, prefix: str, model_name: str, read: Callable[[], SpecDecodingStats | None]) -> None:
        self.prefix, self.model_name, self.read = prefix, model_name, read

    def collect(self) -> Iterator[Metric]:
        stats = self.read()
        if stats is None:
            return
        p, m = self.prefix, self.model_name
        for name, help_text, value in (
                ("spec_decode_num_drafts", "Speculative drafts (one request's draft tokens of one step).",
                 stats.num_drafts),
                ("spec_decode_num_draft_tokens", "Draft tokens proposed.", stats.num_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", stats.num_accepted_tokens)):
            family = CounterMetricFamily(f"{p}:{name}", help_text, labels=["model_name"])
            family.add_metric([m], value)
            yield family
        family = CounterMetricFamily(f"{p}:spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, by position in the draft.", labels=["model_name", "position"])
        for pos, value in enumerate(stats.num_accepted_tokens_per_pos):
            family.add_metric([m, str(pos)], value)
        yield family


class Metrics:
    """Counters and histograms the engine thread records; gauges read live from the scheduler when scraped."""

    def __init__(self, gauges: Callable[[], dict[str, float]], model_name: str = "", prefix: str = PREFIX,
                 spec_decoding_stats: Callable[[], SpecDecodingStats | None] = lambda: None) -> None:
        disable_created_metrics()  # as vLLM: no `_created` series next to each counter and histogram
        self.registry = CollectorRegistry()
        self.model_name = model_name
        p, labels, r = prefix, ["model_name"], self.registry
        self.success = Counter(f"{p}:request_success", "Finished requests by finish reason.",
                               labels + ["finished_reason"], registry=r)
        for reason in FINISH_REASONS:
            self.success.labels(model_name, reason)
        self.prompt_tokens = Counter(f"{p}:prompt_tokens", "Prompt tokens of finished requests.", labels, registry=r)
        self.generation_tokens = Counter(f"{p}:generation_tokens", "Generated tokens.", labels, registry=r)
        self.prefix_cache_queries = Counter(f"{p}:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                            labels, registry=r)
        self.prefix_cache_hits = Counter(f"{p}:prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels,
                                         registry=r)
        self.ttft = Histogram(f"{p}:time_to_first_token_seconds", "Time from arrival to the first token.", labels,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(f"{p}:inter_token_latency_seconds", "Time between two tokens of a request.", labels,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(f"{p}:e2e_request_latency_seconds", "Time from arrival to the end of a request.", labels,
                             buckets=E2E_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram(f"{p}:request_prompt_tokens", "Prompt tokens per finished request.",
                                               labels, buckets=TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram(f"{p}:request_generation_tokens",
                                                   "Generated tokens per finished request.", labels,
                                                   buckets=TOKEN_BUCKETS, registry=r)
        self.params_n = Histogram(f"{p}:request_params_n", "The n of finished requests.", labels, buckets=N_BUCKETS,
                                  registry=r)
        self.params_max_tokens = Histogram(f"{p}:request_params_max_tokens", "The max_tokens of finished requests.",
                                           labels, buckets=TOKEN_BUCKETS, registry=r)
        # Not a vLLM metric (vLLM exports none for structured outputs): requests by the kind of constraint they asked for.
        self.structured_requests = Counter(f"{p}:structured_output_requests", "Requests with structured outputs, by kind.",
                                           labels + ["kind"], registry=r)
        for kind in STRUCTURED_KINDS:
            self.structured_requests.labels(model_name, kind)
        for metric in (self.prompt_tokens, self.generation_tokens, self.prefix_cache_queries, self.prefix_cache_hits,
                       self.ttft, self.itl, self.e2e, self.request_prompt_tokens, self.request_generation_tokens,
                       self.params_n, self.params_max_tokens):
            metric.labels(model_name)  # exported from the start, at zero
        self.registry.register(_Gauges(prefix, model_name, gauges))
        self.registry.register(_SpecDecode(prefix, model_name, spec_decoding_stats))

    def observe_structured(self, kind: str) -> None:
        """A request with structured outputs of this kind was admitted."""
        self.structured_requests.labels(self.model_name, kind).inc()

    def observe_tokens(self, num_new: int, first: bool, seconds: float) -> None:
        """`num_new` tokens of one request arrived `seconds` after its arrival (first) or its previous token."""
        m = self.model_name
        self.generation_tokens.labels(m).inc(num_new)
        if first:
            self.ttft.labels(m).observe(seconds)
        elif num_new:
            self.itl.labels(m).observe(seconds / num_new)

    def observe_finished(self, finish_reason: str, num_prompt_tokens: int, num_generated: int = 0,
                         seconds: float | None = None, n: int = 1, max_tokens: int | None = None,
                         num_cached_tokens: int = 0) -> None:
        """One request ended (whatever its stage: an aborted request may have no token and no prompt count)."""
        m = self.model_name
        self.success.labels(m, finish_reason).inc()
        self.prompt_tokens.labels(m).inc(num_prompt_tokens)
        self.prefix_cache_queries.labels(m).inc(num_prompt_tokens)
        self.prefix_cache_hits.labels(m).inc(num_cached_tokens)
        self.request_prompt_tokens.labels(m).observe(num_prompt_tokens)
        self.request_generation_tokens.labels(m).observe(num_generated)
        self.params_n.labels(m).observe(n)
        if max_tokens is not None:
            self.params_max_tokens.labels(m).observe(max_tokens)
        if seconds is not None:
            self.e2e.labels(m).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
