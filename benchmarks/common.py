"""Timing helpers shared by the benchmarks, and latentserve's `linear` as its layers run it."""
from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

from latentserve.kernels.cpu import last_level_cache_bytes
from latentserve.kernels.policy import default_policy
from latentserve.layers.linear import linear


def best_time(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """Fastest of `repeats` runs in seconds (the machine is noisy; the minimum is the steadiest)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def beyond_cache(num_bytes: int, times: int) -> int:
    """`num_bytes`, or `times` the last-level cache where that is more: a buffer sized for a 32 MiB L3 fits a
    300 MiB one, and a benchmark meant to stream from memory would time the cache instead."""
    return max(num_bytes, times * (last_level_cache_bytes() or 0))


def copy_bandwidth(num_bytes: int | None = None) -> float:
    """Bytes moved per second (read + write) by a plain tensor copy of `num_bytes` (default: 256 MiB, source and
    destination together at least 4x the last-level cache)."""
    if num_bytes is None:
        num_bytes = beyond_cache(256 << 20, 2)
    src = torch.empty(num_bytes // 4, dtype=torch.float32).normal_()
    dst = torch.empty_like(src)
    return 2 * num_bytes / best_time(lambda: dst.copy_(src))


def policy_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`linear` as a layer with this weight runs it under the default kernel policy (this process's setting and
    thread count)."""
    policy = default_policy()
    return linear(x, weight, None, policy.kernels, policy.dense_rows(weight.dtype, weight.shape[1]))


def batch_sizes(parser: argparse.ArgumentParser, text: str, least: int, why: str = "") -> list[int]:
    """The comma-separated batch sizes of a `--batches` option, sorted, each at least `least`; a usage error
    otherwise (`why` says why the least)."""
    try:
        sizes = sorted({int(b) for b in text.split(",")})
    except ValueError:
        parser.error(f"--batches {text!r}: want comma-separated integers")
    if sizes[0] < least:
        parser.error(f"--batches {sizes}: each must be >= {least}{why}")
    return sizes
