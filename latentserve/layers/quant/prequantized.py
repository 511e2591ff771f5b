"""Weights a checkpoint stores already quantized (GPTQ, AWQ, compressed-tensors, GGUF), unpacked into the int4 / int8 /
Q6_K / Q3_K / Q2_K / Q5_0 / Q5_1 / Q5_K / Q4_K layouts latentserve's layers take, so that loading them quantizes
nothing a second time."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from latentserve.layers.quant.int4 import dequantize_int4
from latentserve.layers.quant.int8 import BLOCK_ELEMENTS, quantize_int8


@dataclass
class _Stored:
    """A weight's integers q `[out, in]`; its scales are the format's own fields."""

    q: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


@dataclass
class Int4Weight(_Stored):
    """w = q * scale + minimum per group of contiguous input columns: q uint8 `[out, in]` in [0, 15], scale and
    minimum fp32 `[out, in / group_size]` (`quantize_int4`'s output)."""

    scale: torch.Tensor
    minimum: torch.Tensor
    method = "int4"

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    def dequantize(self) -> torch.Tensor:
        return dequantize_int4(self.q, self.scale, self.minimum)


@dataclass
class Int8Weight(_Stored):
    """w = q * scale[out], symmetric: q int8 `[out, in]`, scale fp32 `[out]` (`quantize_int8`'s output)."""

    scale: torch.Tensor
    method = "int8"

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]


class FileBlocks(_Stored):
    """A GGUF's blocks kept as the file holds them, for latentserve's kernel of that type; `dequantize` gives gguf's
    values to the bit. Where that kernel does not run it runs as `unkept_weight()`, of type `unkept_type`; `unkept`
    says how."""

    unkept_type: type = Int8Weight
    unkept = "dequantized and quantized to int8 per output row"

    def unkept_weight(self) -> Int8Weight | Int4Weight:
        return self.int8()

    def int8(self) -> Int8Weight:
        """Dequantized and quantized to int8 per output row, where latentserve's kernel for the blocks does not run:
        a few rows at a time (a whole lm_head's fp32 values would outweigh the model's other weights)."""
        rows, cols = self.q.shape
        weight = Int8Weight(torch.empty(rows, cols, dtype=torch.int8), torch.empty(rows, dtype=torch.float32))
        step = max(1, BLOCK_ELEMENTS // cols)
        for start in range(0, rows, step):
            part = type(self)(*(getattr(self, f.name)[start:start + step] for f in fields(self)))
            weight.q[start:start + step], weight.scale[start:start + step] = quantize_int8(part.dequantize())
        return weight


Q6K_D_COLUMNS, Q6K_SC_COLUMNS = 256, 16  # input columns per d, per sub-scale sc (Q6_K's and Q3_K's)


@dataclass
class _CentredKQuant(FileBlocks):
    """llama.cpp's Q6_K and Q3_K as a GGUF holds them, w = d * sc * (q - centre): q uint8 `[out, in]`, d fp32
    `[out, in / 256]` (the file's fp16, so exact), sc int8 `[out, in / 16]`. Siblings, neither a subclass of the
    other: their kernels pack different layouts, so no isinstance check may take one for the other."""

    d: torch.Tensor
    sc: torch.Tensor
    centre: ClassVar[int]

    def dequantize(self) -> torch.Tensor:
        """fp32 `[out, in]`, gguf's dequantization to the bit: d * sc rounded to fp32 first, then times q - centre."""
        rows, cols = self.q.shape
        scale = self.d[..., None] * self.sc.view(rows, -1, Q6K_D_COLUMNS // Q6K_SC_COLUMNS).float()
        q = self.q.view(rows, -1, Q6K_SC_COLUMNS).float().sub_(self.centre)
        return (scale.view(rows, -1, 1) * q).view(rows, cols)


@dataclass
class Q6KWeight(_CentredKQuant):
    """Q6_K: q in [0, 63], w = d * sc * (q - 32)."""

    method, centre = "q6_k", 32


@dataclass
class Q3KWeight(_CentredKQuant):
    """Q3_K: q in [0, 7], sc in [-32, 31] (the file's 6-bit scale less 32), w = d * sc * (q - 4)."""

    method, centre = "q3_k", 4


Q50_COLUMNS = 32  # input columns per d


@dataclass
class Q50Weight(FileBlocks):
    """llama.cpp's Q5_0 as a GGUF holds it, w = d * (q - 16): q uint8 `[out, in]` in [0, 31], d fp16
    `[out, in / 32]` (the file's)."""

    d: torch.Tensor
    method = "q5_0"

    def dequantize(self) -> torch.Tensor:
        """fp32 `[out, in]`, gguf's dequantization to the bit: d times q - 16."""
        rows, cols = self.q.shape
        q = self.q.view(rows, -1, Q50_COLUMNS).float().sub_(16)
        return (self.d.float()[..., None] * q).view(rows, cols)


@dataclass
class Q51Weight(FileBlocks):
    """llama.cpp's Q5_1 as a GGUF holds it, w = d * q + m: q uint8 `[out, in]` in [0, 31], d and m fp16
    `[out, in / 32]` (the file's)."""

    d: torch.Tensor
    m: torch.Tensor
    method = "q5_1"

    def dequantize(self) -> torch.Tensor:
        """fp32 `[out, in]`, gguf's dequantization to the bit: d times q, plus m."""
        rows, cols = self.q.shape
        q = self.q.view(rows, -1, Q50_COLUMNS).float()
        return (self.d.float()[..., None] * q + self.m.float()[..., None]).view(rows, cols)


KQUANT_COLUMNS, KQUANT_SUB_COLUMNS = 256, 32  # input columns per d and dmin, per sc and m (Q5_K, Q4_K)
Q2K_SUB_COLUMNS = 16  # Q2_K's input columns per sc and m


@dataclass
class _KQuant(FileBlocks):
    """llama.cpp's Q5_K, Q4_K and Q2_K as a GGUF holds them, w = d * sc * q - dmin * m: q uint8 `[out, in]`, d and
    dmin fp32 `[out, in / 256]` (the file's fp16, so exact), sc and m uint8 `[out, in / sub_columns]`."""

    d: torch.Tensor
    dmin: torch.Tensor
    sc: torch.Tensor
    m: torch.Tensor
    sub_columns = KQUANT_SUB_COLUMNS

    def group_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(d * sc, dmin * m) fp32 `[out, in / sub_columns]`: each group's scale and minimum as gguf forms them."""
        rows, per = self.q.shape[0], KQUANT_COLUMNS // self.sub_columns
        return ((self.d[..., None] * self.sc.view(rows, -1, per).float()).view(rows, -1),
                (self.dmin[..., None] * self.m.view(rows, -1, per).float()).view(rows, -1))

    def dequantize(self) -> torch.Tensor:
        """fp32 `[out, in]`, gguf's dequantization to the bit: (d * sc) * q - dmin * m."""
        rows, cols = self.q.shape
        scale, minimum = self.group_scales()
        q = self.q.view(rows, -1, self.sub_columns).float()
        return (scale[..., None] * q - minimum[..., None]).view(rows, cols)


@dataclass
class Q5KWeight(_KQuant):
    """Q5_K: q in [0, 31]."""

    method = "q5_k"


@dataclass
class Q2KWeight(_KQuant):
    """Q2_K: q in [0, 3], sc and m 4 bits per 16 columns."""

    method, sub_columns = "q2_k", Q2K_SUB_COLUMNS


@dataclass
class Q4KWeight(_KQuant):
    """Q4_K: q in [0, 15]."""

    method, unkept_type = "q4_k", Int4Weight
    unkept = "its values exactly as int4's groups of 32 (scale d * sc, minimum -dmin * m)"

    def unkept_weight(self) -> Int4Weight:
        """Its values as int4's groups of 32, exactly: scale and minimum the fp32 products gguf forms."""
        scale, minimum = self.group_scales()
        return Int4Weight(self.q, scale, -minimum)


QuantizedWeight = (Int4Weight | Int8Weight | Q6KWeight | Q3KWeight | Q2KWeight | Q50Weight | Q51Weight | Q5KWeight
                   | Q4KWeight)


def concat(parts: list[QuantizedWeight | torch.Tensor]) -> QuantizedWeight | torch.Tensor:
    """Weights stacked along outputs (an MLP's gate and up) as one: exact where all are of one format (each output
    row keeps its own scales); a mix (a GGUF may store gate and up in different types) comes back dequantized, to be
    quantized as the load's configuration says."""
    kinds = {(type(p), getattr(p, "group_size", None)) for p in parts}
    if len(kinds) > 1 or isinstance(parts[0], torch.Tensor):
        return torch.cat([p if isinstance(p, torch.Tensor) else p.dequantize() for p in parts])
    return type(parts[0])(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(parts[0])))
