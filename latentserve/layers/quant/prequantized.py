"""Weights a checkpoint stores already quantized (GPTQ, AWQ, compressed-tensors, GGUF), unpacked into the int4 / int8
layouts latentserve's layers take, so that loading them quantizes nothing a second time."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from latentserve.layers.quant.int4 import dequantize_int4


@dataclass
class Int4Weight:
    """w = q * scale + minimum per group of contiguous input columns: q uint8 `[out, in]` in [0, 15], scale and
    minimum fp32 `[out, in / group_size]` (`quantize_int4`'s output)."""

    q: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    method = "int4"

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    def dequantize(self) -> torch.Tensor:
        return dequantize_int4(self.q, self.scale, self.minimum)


@dataclass
class Int8Weight:
    """w = q * scale[out], symmetric: q int8 `[out, in]`, scale fp32 `[out]` (`quantize_int8`'s output)."""

    q: torch.Tensor
    scale: torch.Tensor
    method = "int8"

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]


QuantizedWeight = Int4Weight | Int8Weight


def concat(parts: list[QuantizedWeight | torch.Tensor]) -> QuantizedWeight | torch.Tensor:
    """Weights stacked along outputs (an MLP's gate and up) as one: exact where all are of one format (each output
    row keeps its own scales); a mix (a GGUF may store gate and up in different types) comes back dequantized, to be
    quantized as the load's configuration says."""
    kinds = {(type(p), getattr(p, "group_size", None)) for p in parts}
    if len(kinds) > 1 or isinstance(parts[0], torch.Tensor):
        return torch.cat([p if isinstance(p, torch.Tensor) else p.dequantize() for p in parts])
    if isinstance(parts[0], Int4Weight):
        return Int4Weight(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "scale", "minimum")))
    return Int8Weight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]))
