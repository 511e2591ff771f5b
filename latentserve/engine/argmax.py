"""`argmax` over the vocabulary, the same index as `torch.argmax` at a fraction of its cost on the CPU.

torch's CPU argmax walks a row one element at a time (~0.9 ns per element: 90 us per 102400-token row, 2.7 ms for
32 rows), while `amax` is vectorized (~20x faster). So: the maximum of each chunk of a row (vectorized), the first
chunk holding the row's maximum (argmax over a few hundred values), then the first maximum inside that chunk. The
result is torch's to the index: its first maximum is in the first chunk whose maximum equals the row's, at that
chunk's first maximum; a NaN counts as the maximum in both (amax propagates it, argmax takes the first).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 256  # elements per chunk: a row of 102400 is 400 chunks (chunks of 256 to 1024 cost the same)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Index [...] int64 of the first maximum along the last dim of x [..., V], as `x.argmax(-1)`."""
    if x.shape[-1] == 0:
        raise ValueError(f"argmax over an empty last dimension: {tuple(x.shape)}")
    lead, size = x.shape[:-1], x.shape[-1]
    pad = -size % CHUNK
    # -inf padding at the end of a row is never its first maximum: any real element precedes it and is >= -inf.
    rows = F.pad(x.reshape(-1, size), (0, pad), value=float("-inf")) if pad else x.reshape(-1, size)
    chunks = rows.view(rows.shape[0], rows.shape[1] // CHUNK, CHUNK)
    best = chunks.amax(dim=-1).argmax(dim=-1)  # the first chunk holding each row's maximum
    within = chunks[torch.arange(chunks.shape[0], device=x.device), best].argmax(dim=-1)
    return (best * CHUNK + within).view(lead)
