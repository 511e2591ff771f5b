"""How a GGUF tensor's data becomes latentserve's weights (gguf.py decides which way each tensor goes): Q4_0 and Q4_1
repacked into int4 groups of 32 exactly, Q6_K and Q3_K unpacked into their q, d and sc exactly (`Q6KWeight`,
`Q3KWeight`), Q2_K into its q, d, dmin, sc and m (`Q2KWeight`), Q5_0 into its q and d (`Q50Weight`), Q5_1 into its q, d
and m (`Q51Weight`), Q5_K and Q4_K into their q, d, dmin, sc and m (`Q5KWeight`, `Q4KWeight`), other types dequantized
with gguf's own code (and, for the layers latentserve runs quantized, quantized to int8 per output channel), a few rows
at a time; and the memory a conversion leaves behind (mapped file pages, glibc's freed heap) handed back."""
from __future__ import annotations

import ctypes
import functools
import logging
import mmap
from collections import Counter
from typing import Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K, dequantize

from latentserve.layers.quant.int8 import quantize_int8
from latentserve.layers.quant.prequantized import (KQUANT_COLUMNS, KQUANT_SUB_COLUMNS, Q2K_SUB_COLUMNS, Q6K_D_COLUMNS,
                                                   Q6K_SC_COLUMNS, Q50_COLUMNS, Int4Weight, Int8Weight, Q2KWeight,
                                                   Q3KWeight, Q4KWeight, Q5KWeight, Q6KWeight, Q50Weight, Q51Weight)

logger = logging.getLogger(__name__)

FLOAT_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
INT4_TYPES = {GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1}
_CHUNK_BYTES = 1 << 20  # of a GGUF tensor's data dequantized at a time
_Q6K_BYTES, _Q3K_BYTES, _Q2K_BYTES = 210, 110, 84  # a Q6_K block's, a Q3_K block's, a Q2_K block's, of 256 values
_Q5K_BYTES, _Q4K_BYTES = 176, 144  # a Q5_K block's, a Q4_K block's, of 256 values


def _fp16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[..., at:at + 2].copy().view(np.float16).astype(np.float32)[..., 0]


def int4_weight(data: np.ndarray, kind: GGMLQuantizationType) -> Int4Weight:
    """Q4_0 / Q4_1 rows `[out, bytes]` as groups of 32 columns: the same q, scale and minimum, in fp32 (each an fp16,
    so exact)."""
    rows = data.shape[0]
    # Per 32: fp16 d (Q4_1: and m), 16 bytes: columns 0-15 in the low nibbles, 16-31 in the high ones.
    head = 2 if kind == GGMLQuantizationType.Q4_0 else 4
    blocks = data.reshape(rows, -1, head + 16)
    qs = blocks[..., head:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1)
    scale = _fp16(blocks, 0)
    minimum = -8 * scale if kind == GGMLQuantizationType.Q4_0 else _fp16(blocks, 2)
    as_torch = lambda a: torch.from_numpy(np.ascontiguousarray(a).reshape(rows, -1))  # noqa: E731
    return Int4Weight(as_torch(q), as_torch(scale), as_torch(minimum))


class ConversionStats:
    """What the load did with each tensor, for one log line."""

    def __init__(self) -> None:
        self.repacked, self.kept, self.requantized, self.dequantized = Counter(), Counter(), Counter(), Counter()

    def log(self, name: str) -> None:
        fmt = lambda c: ", ".join(f"{n} {k}" for k, n in sorted(c.items())) or "none"  # noqa: E731
        logger.info("%s: repacked into int4 groups of 32 without requantizing: %s; kept as their blocks: %s; "
                    "dequantized and quantized to int8 per output channel: %s; dequantized to the compute dtype: %s",
                    name, fmt(self.repacked), fmt(self.kept), fmt(self.requantized), fmt(self.dequantized))


def _row_chunks(rows: np.ndarray) -> Iterator[slice]:
    """Slices of a few rows of `[rows, bytes]`: gguf's dequantization makes several temporaries of its input's size
    in fp32; over a whole embedding or lm_head (100k rows) they would outweigh the model's other weights."""
    step = max(1, _CHUNK_BYTES // max(1, rows.strides[0]))
    return (slice(start, start + step) for start in range(0, rows.shape[0], step))


def dequantized(data: np.ndarray, kind: GGMLQuantizationType) -> torch.Tensor:
    """The fp32 values of GGUF data `[..., bytes]` (or of F32 / F16 elements), dequantized a few rows at a time."""
    rows = data.reshape(-1, data.shape[-1])
    out = None
    for chunk in _row_chunks(rows):
        values = dequantize(rows[chunk], kind)
        if out is None:
            out = torch.empty(rows.shape[0], values.shape[-1])
        out.numpy()[chunk] = values  # a copy: F32 values are the mapped file's own
    return out.reshape(*data.shape[:-1], out.shape[-1])


def int8_weight(data: np.ndarray, kind: GGMLQuantizationType) -> Int8Weight:
    """Rows `[out, bytes]` dequantized and quantized to int8 per output row, a few rows at a time (rows are scaled
    each on its own, so this is the whole tensor's quantization)."""
    q = scale = None
    for chunk in _row_chunks(data):
        part_q, part_scale = quantize_int8(dequantized(data[chunk], kind))
        if q is None:
            q = torch.empty(data.shape[0], part_q.shape[1], dtype=torch.int8)
            scale = torch.empty(data.shape[0], dtype=torch.float32)
        q[chunk], scale[chunk] = part_q, part_scale
    return Int8Weight(q, scale)


def q6k_weight(data: np.ndarray) -> Q6KWeight:
    """Q6_K rows `[out, bytes]` as their q, d and sc, a few rows at a time (the unpacking's temporaries are a few
    bytes a value)."""
    rows, blocks = data.shape[0], data.shape[1] // _Q6K_BYTES
    weight = Q6KWeight(torch.empty(rows, blocks * Q6K_D_COLUMNS, dtype=torch.uint8), torch.empty(rows, blocks),
                       torch.empty(rows, blocks * (Q6K_D_COLUMNS // Q6K_SC_COLUMNS), dtype=torch.int8))
    for chunk in _row_chunks(data):
        # Per 256: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 sub-scales, fp16 d. Each half of 128
        # values: its 64 bytes of ql hold values 0-63 (low nibbles) and 64-127 (high); its 32 bytes of qh the top
        # two bits of values 32j + i in bits 2j, 2j + 1 of byte i.
        part = data[chunk].reshape(-1, blocks, _Q6K_BYTES)
        ql = part[..., :128].reshape(-1, blocks, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
        qh = part[..., 128:192].reshape(-1, blocks, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
        q = (ql & 15).reshape(-1, blocks, 2, 4, 32) | ((qh & 3) << 4)
        weight.q.numpy()[chunk] = q.reshape(len(part), -1)
        weight.sc.numpy()[chunk] = part[..., 192:208].view(np.int8).reshape(len(part), -1)
        weight.d.numpy()[chunk] = _fp16(part, 208)
    return weight


def q3k_weight(data: np.ndarray) -> Q3KWeight:
    """Q3_K rows `[out, bytes]` as their q, d and sc, exactly, a few rows at a time: the file's w = d * (sc - 32) *
    (q - 4) (a 6-bit sc per 16 columns, a 3-bit q, an fp16 d per 256) with sc held less 32, as int8 in [-32, 31], the
    form Q6_K's values take too."""
    rows, blocks = data.shape[0], data.shape[1] // _Q3K_BYTES
    weight = Q3KWeight(torch.empty(rows, blocks * Q6K_D_COLUMNS, dtype=torch.uint8), torch.empty(rows, blocks),
                       torch.empty(rows, blocks * (Q6K_D_COLUMNS // Q6K_SC_COLUMNS), dtype=torch.int8))
    for chunk in _row_chunks(data):
        # Per 256: 32 bytes whose bit j of byte i is value 32j + i's third bit, 64 bytes of low bit pairs (each half
        # of 128 values: bits 2j, 2j + 1 of its byte i are value 32j + i's), 12 bytes of 6-bit scales (groups 0-7's
        # low 4 bits in bytes 0-7's low nibbles, 8-15's in their high ones; the top 2 bits of group g in bits
        # 2 (g // 4), + 1 of byte 8 + g % 4), fp16 d.
        part = data[chunk].reshape(-1, blocks, _Q3K_BYTES)
        third = part[..., :32].reshape(-1, blocks, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
        low = part[..., 32:96].reshape(-1, blocks, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
        q = (low & 3).reshape(-1, blocks, 8, 32) | ((third & 1) << 2)
        weight.q.numpy()[chunk] = q.reshape(len(part), -1)
        low4, top2 = part[..., 96:104], part[..., 104:108]
        sc = np.concatenate([low4 & 15, low4 >> 4], axis=-1) | (
            np.concatenate([(top2 >> shift) & 3 for shift in (0, 2, 4, 6)], axis=-1) << 4)
        weight.sc.numpy()[chunk] = (sc.astype(np.int8) - 32).reshape(len(part), -1)
        weight.d.numpy()[chunk] = _fp16(part, 108)
    return weight


def q2k_weight(data: np.ndarray) -> Q2KWeight:
    """Q2_K rows `[out, bytes]` as their q, d, dmin, sc and m, a few rows at a time."""
    rows, blocks = data.shape[0], data.shape[1] // _Q2K_BYTES
    subs = blocks * (KQUANT_COLUMNS // Q2K_SUB_COLUMNS)
    weight = Q2KWeight(torch.empty(rows, blocks * KQUANT_COLUMNS, dtype=torch.uint8), torch.empty(rows, blocks),
                       torch.empty(rows, blocks), torch.empty(rows, subs, dtype=torch.uint8),
                       torch.empty(rows, subs, dtype=torch.uint8))
    for chunk in _row_chunks(data):
        # Per 256: 16 bytes of sub-scales (group g's sc in byte g's low nibble, m in its high one), 64 bytes of bit
        # pairs (each half of 128 values: bits 2j, 2j + 1 of its byte i are value 32j + i's), fp16 d, fp16 dmin.
        part = data[chunk].reshape(-1, blocks, _Q2K_BYTES)
        pairs = part[..., 16:80].reshape(-1, blocks, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
        weight.q.numpy()[chunk] = (pairs & 3).reshape(len(part), -1)
        weight.sc.numpy()[chunk] = (part[..., :16] & 15).reshape(len(part), -1)
        weight.m.numpy()[chunk] = (part[..., :16] >> 4).reshape(len(part), -1)
        weight.d.numpy()[chunk] = _fp16(part, 80)
        weight.dmin.numpy()[chunk] = _fp16(part, 82)
    return weight


def _five_bit_weight(data: np.ndarray, kind: type[Q50Weight] | type[Q51Weight]) -> Q50Weight | Q51Weight:
    """Q5_0 rows `[out, bytes]` as their q and d, Q5_1 rows as their q, d and m, a few rows at a time."""
    halves = 2 if kind is Q51Weight else 1  # the fp16 values heading a block: d (Q5_1: and m)
    size = 2 * halves + 20
    rows, blocks = data.shape[0], data.shape[1] // size
    weight = kind(torch.empty(rows, blocks * Q50_COLUMNS, dtype=torch.uint8),
                  *(torch.empty(rows, blocks, dtype=torch.float16) for _ in range(halves)))
    for chunk in _row_chunks(data):
        # Per 32: fp16 d (Q5_1: and m), 4 bytes whose bit i is value i's fifth, 16 bytes: values 0-15 in the low
        # nibbles, 16-31 in the high ones.
        part = data[chunk].reshape(-1, blocks, size)
        head = 2 * halves
        fifth = np.unpackbits(part[..., head:head + 4], axis=-1, bitorder="little")
        low = np.concatenate([part[..., head + 4:] & 15, part[..., head + 4:] >> 4], axis=-1)
        weight.q.numpy()[chunk] = (low | (fifth << 4)).reshape(len(part), -1)
        weight.d.numpy()[chunk] = _fp16(part, 0)  # fp16's values back in fp16: exact
        if kind is Q51Weight:
            weight.m.numpy()[chunk] = _fp16(part, 2)
    return weight


def q50_weight(data: np.ndarray) -> Q50Weight:
    return _five_bit_weight(data, Q50Weight)


def q51_weight(data: np.ndarray) -> Q51Weight:
    return _five_bit_weight(data, Q51Weight)


def _kquant_weight(data: np.ndarray, bits: int) -> Q5KWeight | Q4KWeight:
    """Q5_K (bits 5) or Q4_K (4) rows `[out, bytes]` as their q, d, dmin, sc and m, a few rows at a time."""
    size, kind = (_Q5K_BYTES, Q5KWeight) if bits == 5 else (_Q4K_BYTES, Q4KWeight)
    rows, blocks = data.shape[0], data.shape[1] // size
    subs = KQUANT_COLUMNS // KQUANT_SUB_COLUMNS
    weight = kind(torch.empty(rows, blocks * KQUANT_COLUMNS, dtype=torch.uint8), torch.empty(rows, blocks),
                  torch.empty(rows, blocks), torch.empty(rows, blocks * subs, dtype=torch.uint8),
                  torch.empty(rows, blocks * subs, dtype=torch.uint8))
    for chunk in _row_chunks(data):
        # Per 256: fp16 d and dmin, 12 bytes of 6-bit scales and minimums, (Q5_K) 32 bytes whose bit j of byte i is
        # value 32j + i's fifth, 128 bytes: sub-blocks 2c (low nibbles) and 2c + 1 (high) of 32 bytes each.
        part = data[chunk].reshape(-1, blocks, size)
        sc, m = Q4_K.get_scale_min(part[..., 4:16].reshape(-1, 12))
        qs = part[..., size - 128:].reshape(-1, blocks, 4, 1, 32)
        q = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(-1, blocks, 8, 32)
        if bits == 5:
            fifth = part[..., 16:48].reshape(-1, blocks, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
            q = q | ((fifth & 1) << 4)
        weight.q.numpy()[chunk] = q.reshape(len(part), -1)
        weight.d.numpy()[chunk], weight.dmin.numpy()[chunk] = _fp16(part, 0), _fp16(part, 2)
        weight.sc.numpy()[chunk], weight.m.numpy()[chunk] = sc.reshape(len(part), -1), m.reshape(len(part), -1)
    return weight


def q5k_weight(data: np.ndarray) -> Q5KWeight:
    return _kquant_weight(data, 5)


def q4k_weight(data: np.ndarray) -> Q4KWeight:
    return _kquant_weight(data, 4)


def release_mapped_pages(data: np.ndarray) -> None:
    """Take a converted tensor's pages of the mapped file out of the process (madvise MADV_DONTNEED): each page the
    conversion read counts as the process's memory until then, so a whole file's worth by the end of the load. The
    file stays in the page cache; a page touched again is read back from it. Without madvise nothing is done."""
    advise = getattr(mmap, "MADV_DONTNEED", None)
    if advise is None or data.nbytes == 0:
        return
    start = data.ctypes.data
    aligned = start - start % mmap.PAGESIZE
    # A page shared with the next tensor is dropped too: only read, it is faulted back in from the page cache.
    _libc().madvise(ctypes.c_void_p(aligned), ctypes.c_size_t(start + data.nbytes - aligned), advise)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def release_freed_heap() -> None:
    """Hand glibc's freed heap pages back to the system. Unpacking a GGUF tensor makes numpy temporaries of a few MiB
    each, which glibc frees into its heap and keeps: on a 1.4 GiB Q4_K_M file, 3.3 GiB of the process's RSS after
    the load. Elsewhere than glibc (no malloc_trim) nothing is done."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)
