"""Batch-invariant mode (vLLM's name): a token's numbers do not depend on what else its step computes.

Every product whose kernel is chosen by row count (linears, MLA's per-head products, MoE routing and experts) takes
the row-wise kernel it takes at a few rows, at every row count: latentserve's kernels compute each row on its own,
with the same sums in the same order whatever the other rows; quantized experts run each token as it would run
alone. Attention runs every token on the decode path (its cache rows in fixed chunks, kernels/mla_decode.c), so
neither the batch nor prefill chunking nor a prefix-cache hit changes a token's result. The engine turns the mode on
around each step (`enabled_during`); layers read `is_enabled()`. The flag is process-wide, as vLLM's is: DBO's
ubatch threads see it too.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

_enabled = False


def is_enabled() -> bool:
    return _enabled


@contextmanager
def enabled_during(on: bool) -> Iterator[None]:
    """The mode set to `on` inside the block, restored after it."""
    global _enabled
    previous, _enabled = _enabled, on
    try:
        yield
    finally:
        _enabled = previous
