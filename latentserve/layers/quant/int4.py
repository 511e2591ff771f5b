"""int4 weights, asymmetric per group of `group_size` input columns: w ≈ q * scale + minimum, q in [0, 15]."""
from __future__ import annotations

import functools
import threading

import torch
import torch.nn.functional as F
from torch import nn

from latentserve.layers.linear import linear
from latentserve.kernels import native
from latentserve.layers.quant.int8 import BLOCK_ELEMENTS

# From this many rows on, dequantizing the weight once and running one plain GEMM beats int4pack_mm, whose cost
# grows with every 4 rows (the crossover measured between 64 and 128 rows on V2-Lite's shapes, about the same for
# every shape since both sides scale with the weight: benchmarks/RESULTS.md, "Quantized kernels per shape").
INT4_DEQUANT_ROWS = 128


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 `[out, in]` in [0, 15], scale fp32 `[out, in/g]`, minimum fp32 `[out, in/g]`):
    q = round((w - minimum) / scale) per group, scale = (max - minimum) / 15."""
    out_features, in_features = weight.shape
    groups = in_features // group_size
    q = torch.empty(out_features, in_features, dtype=torch.uint8, device=weight.device)
    scale = torch.empty(out_features, groups, dtype=torch.float32, device=weight.device)
    minimum = torch.empty_like(scale)
    rows = max(1, BLOCK_ELEMENTS // in_features)  # blockwise, as quantize_int8 (same values as all at once)
    for start in range(0, out_features, rows):
        w = weight[start:start + rows].to(torch.float32, copy=True).view(-1, groups, group_size)
        lo, s = minimum[start:start + rows], scale[start:start + rows]
        # amax and amin apart: one aminmax over short groups measured 8x slower than both together.
        torch.amin(w, dim=-1, out=lo)
        torch.div(torch.amax(w, dim=-1).sub_(lo).clamp_(min=1e-12), 15, out=s)
        q[start:start + rows] = w.sub_(lo[..., None]).div_(s[..., None]).round_().clamp_(0, 15).view(-1, in_features)
    return q, scale, minimum


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """fp32 `[out, in]` from `quantize_int4`'s output."""
    groups = scale.shape[1]
    w = q.view(q.shape[0], groups, -1).float() * scale[..., None] + minimum[..., None]
    return w.view(q.shape)


class Int4Linear(nn.Module):
    """The portable kernel: two weights per byte, dequantized to the activations' dtype at each call."""

    kernel = "int4 dequantize + matmul"

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.register_buffer("qweight", q[:, 0::2] | (q[:, 1::2] << 4))
        self.register_buffer("scale", scale)
        self.register_buffer("minimum", minimum)
        self.bias = bias

    def dequantized(self) -> torch.Tensor:
        q = torch.stack([self.qweight & 15, self.qweight >> 4], dim=-1).view(self.out_features, self.in_features)
        return dequantize_int4(q, self.scale, self.minimum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.dequantized().to(x.dtype), self.bias)


def _unpack(packed: torch.Tensor, block_n: int, out_features: int, in_features: int) -> torch.Tensor:
    """uint8 `[out, in]` in [0, 15] from `_convert_weight_to_int4pack_for_cpu`'s layout with `block_n` output rows per
    block: byte [b, k, j] holds rows b*block_n + j (low nibble) and b*block_n + block_n/2 + j (high) at column k."""
    blocks = packed.view(out_features // block_n, in_features, block_n // 2)
    return torch.cat([blocks & 15, blocks >> 4], dim=-1).transpose(1, 2).reshape(out_features, in_features)


_scratch = threading.local()  # per thread: DBO's ubatch threads each dequantize into their own


def _scratch_tensor(slot: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat scratch tensor of `numel` reused from call to call: the fresh pages of a new multi-MB tensor cost more
    than the dequantization itself (one page fault per 4 KiB; measured 5-10x the arithmetic in this VM)."""
    buffers = _scratch.__dict__.setdefault("buffers", {})
    buffer = buffers.get((slot, dtype))
    if buffer is None or buffer.numel() < numel:
        buffer = buffers[(slot, dtype)] = torch.empty(numel, dtype=dtype)
    return buffer[:numel]


@functools.cache
def int4pack_block_n() -> int | None:
    """Output rows per block of the int4pack layout on this CPU (torch packs 64 with AVX-512, 32 with AVX2), found
    by packing a probe; None where it is neither (then layers never dequantize it)."""
    probe = torch.randint(0, 16, (128, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
    if packed.dtype != torch.uint8 or packed.shape != (128, 32):
        return None
    return next((b for b in (64, 32) if torch.equal(_unpack(packed, b, 128, 64), probe.to(torch.uint8))), None)


class Int4PackLinear(nn.Module):
    """PyTorch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`): packed nibbles, per-group scale and zero in the
    activations' dtype (`compute_dtype`: bf16 is its fast path, on AVX2 too; fp32 is exact but far slower). From
    `dequant_rows` rows on (None: never) the weight is dequantized to `gemm_dtype` (None: `compute_dtype`) for one
    plain GEMM instead (fp32 where bf16 GEMMs are emulated)."""

    kernel = "int4pack_mm"

    def __init__(
        self, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bias: nn.Parameter | None,
        compute_dtype: torch.dtype, gemm_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.group_size = q.shape[1] // scale.shape[1]
        self.compute_dtype = self.activation_dtype = compute_dtype
        self.gemm_dtype = gemm_dtype or compute_dtype
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1))
        # The kernel computes (q - 8) * scale + zero.
        zero = minimum + 8 * scale
        self.register_buffer("scales_and_zeros", torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
                             .to(compute_dtype))
        self.bias = bias
        block_n = int4pack_block_n()
        self.block_n = block_n if block_n is not None and self.out_features % block_n == 0 else None
        self.dequant_rows = INT4_DEQUANT_ROWS if self.block_n is not None else None

    def dequantized(self) -> torch.Tensor:
        """The weight `[out, in]` in `gemm_dtype`, as the kernel sees it: (q - 8) * scale + zero. It lives in this
        thread's scratch space until the next call."""
        n, k, b = self.out_features, self.in_features, self.block_n
        blocks = self.packed.view(n // b, k, b // 2)
        nibbles = _scratch_tensor("nibbles", blocks.numel(), torch.uint8).view(blocks.shape)
        q = _scratch_tensor("q", n * k, torch.uint8)
        # Rows b*block_n + j are low nibbles, b*block_n + block_n/2 + j high ones (`_unpack`). Transposing in uint8
        # and converting contiguous bytes measured 3x faster than converting while transposing.
        halves = q.view(n // b, 2, b // 2, k)
        halves[:, 0].copy_(torch.bitwise_and(blocks, 15, out=nibbles).transpose(1, 2))
        halves[:, 1].copy_(torch.bitwise_right_shift(blocks, 4, out=nibbles).transpose(1, 2))
        shape = (n, k // self.group_size, self.group_size)
        w = _scratch_tensor("weight", n * k, self.gemm_dtype).view(shape).copy_(q.view(shape))
        sz = self.scales_and_zeros.transpose(0, 1).float()  # [out, groups, 2]
        scale, minimum = sz[..., :1], sz[..., 1:] - 8 * sz[..., :1]  # q * scale + minimum: two passes, not three
        # In place, one op each: a fused addcmul measured 3x slower in bf16.
        return w.mul_(scale.to(self.gemm_dtype)).add_(minimum.to(self.gemm_dtype)).view(n, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dequant_rows is not None and x.shape[0] >= self.dequant_rows:
            y = F.linear(x.to(self.gemm_dtype), self.dequantized())
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(self.compute_dtype), self.packed, self.group_size, self.scales_and_zeros
            )
        y = y.to(x.dtype)
        return y if self.bias is None else y.add_(self.bias)


class NativeInt4Linear(nn.Module):
    """latentserve's int4 kernel (`kernels/native/`, activations quantized to int8 per 64 columns) at every row count: in
    blocks of 16 outputs it runs 1.4-1.9x faster than dequantizing the weight for one bf16 GEMM even at 512 rows
    (benchmarks/RESULTS.md). Scale and minimum are kept in bf16 beside the nibbles of each block, as int4pack_mm
    keeps them (half a bit per weight at group size 64 instead of one)."""

    kernel = "latentserve int4"

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bias: nn.Parameter | None,
                 kernels: native.NativeKernels) -> None:
        super().__init__()
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        self.group_size = q.shape[1] // scale.shape[1]
        self.kernels = kernels
        self.register_buffer("packed", native.pack_int4(q, scale, minimum))
        self.bias = bias

    @property
    def expert_format(self) -> native.Format:
        """Its weight's format as the native experts read it."""
        return 4, self.group_size

    def native_weight(self, dtype: torch.dtype, kernels: native.NativeKernels) -> tuple[native.Weight, None] | None:
        """(this layer as a one-call block reads it, None: it runs latentserve's kernel at any row count) where it
        runs `kernels` without a bias; else None."""
        if self.kernels != kernels or self.bias is not None:
            return None
        return native.Weight(kind=native.INT4, w=self.packed.data_ptr(), group=self.group_size), None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = native.activations(x, self.in_features)
        y = native.int4_linear(self.kernels, x2, self.packed, self.group_size, self.out_features, x.dtype)
        y = y.view(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y.add_(self.bias)
