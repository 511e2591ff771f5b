"""`argmax` over the vocabulary, the same index as `torch.argmax` at a fraction of its cost on the CPU.

Where latentserve's kernels load, fp32 rows (the sampler's logits) take theirs (kernels/argmax.c: two vectorized
passes a row; a 102400-token row ~20 us with its call, 32 rows ~120 us, where torch's took ~90-180 and ~1400).
Elsewhere (no kernels, another dtype or device, strided rows) the chunked argmax below.

torch's CPU argmax walks a row one element at a time (~0.9 ns per element: 90 us per 102400-token row, 2.7 ms for
32 rows), while `amax` is vectorized (~15x faster). So: the maximum of each chunk of a row (vectorized), the first
chunk holding the row's maximum (argmax over a few hundred values), then the first maximum inside that chunk. The
result is torch's to the index: its first maximum is in the first chunk whose maximum equals the row's, at that
chunk's first maximum; a NaN counts as the maximum in both (amax propagates it, argmax takes the first).

A single row takes torch's argmax: in an engine step the ~20 small ops below cost more than its one walk
(benchmarks/decode_profile.py's sampling part at batch 1: 0.20 ms with torch's, 0.34 ms with these; at batch 8:
2.9 ms against 0.63 ms).

The chunk maxima are taken a slice at a time, each small enough that PyTorch runs it on the calling thread: a larger
op wakes PyTorch's own thread pool, and in an engine step, where latentserve's kernels' OpenMP threads have just had
the cores, that wake-up costs ~1 ms of a 2-thread step (benchmarks/decode_profile.py), ten times the whole argmax.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from latentserve.kernels import native
from latentserve.kernels.policy import default_policy

CHUNK = 256  # elements per chunk: a row of 102400 is 400 chunks (chunks of 256 to 1024 cost the same)
SERIAL_ELEMENTS = 32767  # PyTorch runs an op of fewer elements than its grain size (32768) on the calling thread


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Index [...] int64 of the first maximum along the last dim of x [..., V], as `x.argmax(-1)`."""
    if x.shape[-1] == 0:
        raise ValueError(f"argmax over an empty last dimension: {tuple(x.shape)}")
    if x.dim() == 2 and x.dtype == torch.float32 and x.is_cpu and x.is_contiguous():
        kernels = default_policy().kernels
        if kernels is not None:
            return native.argmax(kernels, x)
    lead, size = x.shape[:-1], x.shape[-1]
    if x.numel() == size:
        return x.argmax(dim=-1)
    pad = -size % CHUNK
    # -inf padding at the end of a row is never its first maximum: any real element precedes it and is >= -inf.
    rows = F.pad(x.reshape(-1, size), (0, pad), value=float("-inf")) if pad else x.reshape(-1, size)
    chunks = rows.view(-1, CHUNK)
    maxima = chunks.new_empty(chunks.shape[0])
    step = SERIAL_ELEMENTS // CHUNK
    for start in range(0, chunks.shape[0], step):
        torch.amax(chunks[start : start + step], dim=-1, out=maxima[start : start + step])
    per_row = rows.shape[1] // CHUNK
    best = maxima.view(-1, per_row).argmax(dim=-1)  # the first chunk holding each row's maximum
    within = chunks.view(-1, per_row, CHUNK)[torch.arange(rows.shape[0], device=x.device), best].argmax(dim=-1)
    return (best * CHUNK + within).view(lead)
