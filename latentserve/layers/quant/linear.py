"""Quantize a linear layer's weight as it is loaded, with the fastest kernel the `KernelPolicy` offers for its shape:
each format's candidates in order, the first that can take the layer wins, with its reason (as vLLM chooses its
mixed-precision linear kernels)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from latentserve.layers.quant.config import QuantConfig, int4_group
from latentserve.kernels.policy import KernelPolicy, default_policy
from latentserve.layers.quant.int4 import (
    INT4_DEQUANT_ROWS, Int4Linear, Int4PackLinear, NativeInt4Linear, int4pack_block_n, quantize_int4,
)
from latentserve.layers.quant.int8 import (
    Int8Linear, IntMMInt8Linear, NativeInt8Linear, int_mm_parts, quantize_int8,
)
from latentserve.layers.quant.prequantized import (FileBlocks, Int4Weight, Int8Weight, Q2KWeight, Q3KWeight, Q4KWeight,
                                                   Q5KWeight, Q6KWeight, Q50Weight, Q51Weight, QuantizedWeight)
from latentserve.layers.quant.q45 import NativeQ4KLinear, NativeQ5KLinear, NativeQ50Linear, NativeQ51Linear
from latentserve.layers.quant.q6k import NativeQ2KLinear, NativeQ3KLinear, NativeQ6KLinear

INT4PACK_OUT_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu packs 16 output rows at a time
LM_HEAD = "lm_head"


@dataclass(frozen=True)
class KernelChoice:
    kernel: str
    reason: str


def int8_kernel(policy: KernelPolicy, device: torch.device, in_features: int | None = None) -> KernelChoice:
    if device.type != "cpu":
        return KernelChoice(Int8Linear.kernel, "not a CPU")
    kernels, why = policy.kernels, policy.why
    if kernels is not None and (in_features is None or in_features % 4 == 0):
        return KernelChoice(NativeInt8Linear.kernel, f"built for {kernels.isa} ({why}); at every row count, the weight "
                            "in blocks of 16 outputs (faster than oneDNN's int8 GEMM at 512 rows: "
                            "benchmarks/RESULTS.md)")
    if kernels is not None:
        why = f"{in_features} inputs, latentserve's int8 kernel needs a multiple of 4"
    parts = ("" if int_mm_parts() == 1 else
             "; _int_mm saturates without VNNI: the weight in two parts, two products a call, twice the memory")
    return KernelChoice(IntMMInt8Linear.kernel, f"latentserve's kernels: {why}; their arithmetic through torch (the "
                        f"same bits, slower at few rows: benchmarks/RESULTS.md){parts}")


def int4_kernel(policy: KernelPolicy, device: torch.device, out_features: int | None = None,
                in_features: int | None = None) -> KernelChoice:
    if device.type != "cpu":
        return KernelChoice(Int4Linear.kernel, "not a CPU")
    kernels, why, features = policy.kernels, policy.why, policy.features
    gemm = "bf16" if features.native_bf16 else "fp32 (bf16 is emulated here)"
    if kernels is not None and (in_features is None or in_features % 64 == 0):
        return KernelChoice(NativeInt4Linear.kernel, f"built for {kernels.isa} ({why}); at every row count (faster than "
                            f"one dequantized {gemm} GEMM up to 2048 rows measured: benchmarks/RESULTS.md)")
    if kernels is not None:
        why = f"{in_features} inputs, latentserve's int4 kernel needs a multiple of 64"
    if out_features is not None and out_features % INT4PACK_OUT_MULTIPLE:
        return KernelChoice(Int4Linear.kernel, f"{out_features} outputs, int4pack_mm needs a multiple of "
                            f"{INT4PACK_OUT_MULTIPLE}")
    block_n = int4pack_block_n()
    many_rows = (f"from {INT4_DEQUANT_ROWS} rows the weight is unpacked (blocks of {block_n} rows here) for one {gemm} "
                 "GEMM" if block_n else "int4pack layout unknown here: int4pack_mm at every row count")
    return KernelChoice(Int4PackLinear.kernel, f"latentserve's kernels: {why}; PyTorch's CPU int4 kernel, bf16 "
                        "activations on any CPU (its fp32 path measured 25-100x slower, benchmarks/RESULTS.md); "
                        f"{many_rows}")


# A GGUF's weights latentserve runs in their file's blocks: the weight's type, its layer.
FILE_BLOCKS = {Q6KWeight: NativeQ6KLinear, Q3KWeight: NativeQ3KLinear, Q2KWeight: NativeQ2KLinear,
               Q50Weight: NativeQ50Linear, Q51Weight: NativeQ51Linear, Q5KWeight: NativeQ5KLinear,
               Q4KWeight: NativeQ4KLinear}


def blocks_kernel(weight: type[FileBlocks], policy: KernelPolicy, device: torch.device,
                  in_features: int | None = None) -> KernelChoice:
    """A GGUF weight of a type in `FILE_BLOCKS` (Q6_K, Q3_K, Q2_K, Q5_0, Q5_1, Q5_K, Q4_K): latentserve's kernel for it
    on its blocks as they are, else the kernel of its `unkept_type` (int8 per output row; Q4_K int4's groups)."""
    layer = FILE_BLOCKS[weight]
    unkept = (int4_kernel(policy, device, None, in_features) if weight.unkept_type is Int4Weight
              else int8_kernel(policy, device, in_features)).kernel
    if device.type != "cpu":
        return KernelChoice(unkept, f"not a CPU: {weight.unkept}")
    kernels, why = policy.kernels, policy.why
    if kernels is not None and (in_features is None or in_features % layer.columns == 0):
        return KernelChoice(layer.kernel, f"built for {kernels.isa} ({why}); the file's {layer.file_type} blocks as "
                            f"they are ({layer.read})")
    if kernels is not None:
        why = (f"{in_features} inputs, latentserve's {layer.file_type} kernel needs a multiple of "
               f"{layer.columns}")
    return KernelChoice(unkept, f"latentserve's kernels: {why}; {weight.unkept}")


def quantize_linear(
    name: str, weight: torch.Tensor | QuantizedWeight, bias: nn.Parameter | None, config: QuantConfig,
    device: torch.device | str, policy: KernelPolicy | None = None
) -> nn.Module:
    """The quantized stand-in for the linear layer `name` with this weight: full precision (quantized as `config` says),
    or already quantized by the checkpoint (kept as it is, in its own format: a GGUF may mix int4 and int8 layers; a
    weight of a type in `FILE_BLOCKS` runs `blocks_kernel`'s choice). `lm_head` is int8 under int4 too, as llama.cpp's
    Q4_K_M keeps its output matrix at 6 bits: int4pack_mm's cost grows with every 4 rows (one row per sequence here),
    int8's barely (benchmarks/RESULTS.md), and the logits keep int8's accuracy. `policy`: the loader's (None: the
    default one)."""
    device, policy = torch.device(device), policy or default_policy()
    # The logits stay in the kernel's fp32 (compute_logits wants fp32): no round trip through bf16.
    out_dtype = torch.float32 if name == LM_HEAD else None
    layer = FILE_BLOCKS.get(type(weight))
    if layer is not None:
        if blocks_kernel(type(weight), policy, device, weight.shape[1]).kernel == layer.kernel:
            return layer.of(weight, bias, policy.kernels, out_dtype)
        weight = weight.unkept_weight()
    if name == LM_HEAD and config.method == "int4":
        config = QuantConfig("int8")
        if isinstance(weight, Int4Weight):
            weight = weight.dequantize()
    if isinstance(weight, (Int4Weight, Int8Weight)):
        config = QuantConfig(weight.method, getattr(weight, "group_size", None))
    features = policy.features
    if config.method == "int8":
        q, scale = (weight.q, weight.scale) if isinstance(weight, Int8Weight) else quantize_int8(weight)
        kernel = int8_kernel(policy, device, weight.shape[1]).kernel
        if kernel == NativeInt8Linear.kernel:
            return NativeInt8Linear(q, scale, bias, policy.kernels, out_dtype)
        if kernel == IntMMInt8Linear.kernel:
            return IntMMInt8Linear(q, scale, bias, out_dtype)
        return Int8Linear(q.to(device), scale.to(device), bias)
    q, scale, minimum = ((weight.q, weight.scale, weight.minimum) if isinstance(weight, Int4Weight)
                         else quantize_int4(weight, int4_group(config, name, weight.shape[1])))
    kernel = int4_kernel(policy, device, *weight.shape).kernel
    if kernel == NativeInt4Linear.kernel:
        return NativeInt4Linear(q, scale, minimum, bias, policy.kernels)
    if kernel == Int4PackLinear.kernel:
        return Int4PackLinear(q, scale, minimum, bias, torch.bfloat16,
                              torch.bfloat16 if features.native_bf16 else torch.float32)
    return Int4Linear(q.to(device), scale.to(device), minimum.to(device), bias)
