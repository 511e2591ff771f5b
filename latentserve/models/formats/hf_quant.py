"""Quantized Hugging Face checkpoints: GPTQ and AWQ 4-bit, compressed-tensors pack-quantized (W4A16) and int8
channel-wise (W8A8). Each layer's packed tensors are unpacked into `Int4Weight` / `Int8Weight`, which the loader
installs as they are: no second quantization where the format maps onto latentserve's (int4: q * scale + minimum
per group of 32/64/128 contiguous input columns; int8: symmetric per output channel).

What maps exactly: GPTQ/AWQ/compressed-tensors int4 with a group size of 32, 64 or 128 dividing the input, and
GPTQ act-order whose g_idx keeps each such run of columns in one group (it then only permutes the groups' scales
and zeros); compressed-tensors int8 channel-wise. The values q, scale and minimum are exact in fp32 (a zero is an
integer, a scale fp16/bf16); latentserve's int4 kernels then keep scale and minimum in bf16 (see docs/formats.md).
Anything else (an act-order g_idx that scatters a group's columns, another group size) is dequantized here and
quantized at load as the configuration says, and the load log says so."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from latentserve.layers.quant.config import INT4_GROUP_SIZES, PrequantizedConfig
from latentserve.layers.quant.prequantized import Int4Weight, Int8Weight

logger = logging.getLogger(__name__)

HF_QUANT_METHODS = ("gptq", "awq", "compressed-tensors")
# The tensors each format stores per quantized layer, in place of `weight` (those of them the checkpoint has).
PARTS = {
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
    "pack-quantized": ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx"),
    "int-quantized": ("weight", "weight_scale", "weight_zero_point"),
}
# Of those, the ones every layer must have (the others: where the checkpoint's names show them).
REQUIRED = {"gptq": {"qweight", "qzeros", "scales"}, "awq": {"qweight", "qzeros", "scales"},
            "pack-quantized": {"weight_packed", "weight_scale", "weight_shape"},
            "int-quantized": {"weight", "weight_scale"}}
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # output 8j + k sits in nibble AWQ_ORDER[k] of its int32 (AutoAWQ's GEMM pack)


@dataclass(frozen=True)
class HfQuantConfig(PrequantizedConfig):
    """config.json `quantization_config` of a GPTQ, AWQ or compressed-tensors checkpoint latentserve unpacks."""

    layout: str = ""  # a key of PARTS
    zero_offset: int = 0  # GPTQ's v1 checkpoints store each zero minus one


def parse_hf_quant(raw: dict[str, Any]) -> HfQuantConfig:
    """The checkpoint's format from its `quantization_config`, or a ValueError naming the field it cannot take."""
    where = "config.json quantization_config"
    method = raw.get("quant_method")
    if method == "gptq":
        _require(raw, where, bits=4, sym=(True, False))
        v1 = raw.get("checkpoint_format", "gptq") == "gptq"
        return HfQuantConfig("gptq", "int4", _group(raw.get("group_size"), where), "gptq", 1 if v1 else 0)
    if method == "awq":
        _require(raw, where, bits=4, zero_point=True, version="gemm")
        return HfQuantConfig("awq", "int4", _group(raw.get("group_size", raw.get("q_group_size")), where), "awq")
    if method == "compressed-tensors":
        return _compressed_tensors(raw, where)
    raise ValueError(f"{where}: quant_method {method!r}; supported: 'fp8', {', '.join(map(repr, HF_QUANT_METHODS))}")


def _require(raw: dict, where: str, **expected) -> None:
    for field, allowed in expected.items():
        allowed = allowed if isinstance(allowed, tuple) else (allowed,)
        value = raw.get(field, raw.get("w_bit") if field == "bits" else allowed[0])
        if isinstance(value, str):
            value = value.lower()
        if value not in allowed:
            raise ValueError(f"{where}: field {field!r} is {value!r}; supported: {list(allowed)}")


def _group(size: Any, where: str) -> int:
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"{where}: field 'group_size' must be a positive int (per-channel -1 is not supported), "
                         f"got {size!r}")
    return size


def _compressed_tensors(raw: dict, where: str) -> HfQuantConfig:
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise ValueError(f"{where}: compressed-tensors needs exactly one entry in 'config_groups', got {groups!r}")
    scheme = next(iter(groups.values()))
    weights, acts = scheme.get("weights") or {}, scheme.get("input_activations")
    layout = scheme.get("format") or raw.get("format")
    if weights.get("type", "int") != "int" or layout not in ("pack-quantized", "int-quantized"):
        raise ValueError(f"{where}: compressed-tensors format {layout!r} with {weights.get('type')!r} weights; "
                         "supported: 'pack-quantized' (int4 W4A16) and 'int-quantized' (int8 W8A8 channel-wise)")
    if layout == "pack-quantized":
        if weights.get("num_bits") != 4 or weights.get("strategy") != "group" or acts is not None:
            raise ValueError(f"{where}: pack-quantized needs 4-bit weights per group and no activation "
                             f"quantization (W4A16), got weights {weights!r}, input_activations {acts!r}")
        return HfQuantConfig("compressed-tensors", "int4", _group(weights.get("group_size"), where), layout)
    dynamic_tokens = isinstance(acts, dict) and acts.get("dynamic") is True and acts.get("strategy") == "token"
    if (weights.get("num_bits") != 8 or weights.get("strategy") != "channel" or not weights.get("symmetric", True)
            or not (acts is None or dynamic_tokens)):
        raise ValueError(f"{where}: int-quantized needs symmetric 8-bit weights per channel and activations "
                         f"quantized per token at run time (or not at all), got weights {weights!r}, "
                         f"input_activations {acts!r}")
    return HfQuantConfig("compressed-tensors", "int8", None, layout)


def layer_of(name: str, config: HfQuantConfig) -> str:
    """The `weight` a checkpoint tensor belongs to: `x.qweight` -> `x.weight` (others unchanged)."""
    prefix, _, part = name.rpartition(".")
    return f"{prefix}.weight" if part in PARTS[config.layout] else name


def unpack(tensors: Iterator[tuple[str, torch.Tensor]], config: HfQuantConfig,
           names: set[str]) -> Iterator[tuple[str, torch.Tensor | Int4Weight | Int8Weight]]:
    """Every quantized layer's weight (`prefix.weight`) once all of its parts in `names` (the checkpoint's tensor
    names) are read; every other tensor passes through. A non-integer `weight` of an int-quantized checkpoint is a
    layer it left unquantized."""
    parts = PARTS[config.layout]
    pending: dict[str, dict[str, torch.Tensor]] = {}
    requantized = []
    for name, tensor in tensors:
        prefix, _, part = name.rpartition(".")
        if part not in parts or (part == "weight" and tensor.dtype != torch.int8):
            yield name, tensor
            continue
        layer = pending.setdefault(prefix, {})
        layer[part] = tensor
        if REQUIRED[config.layout] <= layer.keys() and all(f"{prefix}.{p}" not in names or p in layer for p in parts):
            weight = _UNPACK[config.layout](pending.pop(prefix), config, prefix)
            if isinstance(weight, torch.Tensor):
                requantized.append(prefix)
            yield f"{prefix}.weight", weight
    if pending:
        prefix, layer = next(iter(pending.items()))
        missing = sorted(REQUIRED[config.layout] - layer.keys())
        raise ValueError(f"{config.quant_method} layer {prefix!r} is missing {missing} in the checkpoint")
    if requantized:
        logger.warning("%s: %d layer(s) do not map onto latentserve's int4 groups exactly (e.g. %s: an act-order "
                       "g_idx that scatters a group's columns, or a group size other than %s); they are "
                       "dequantized and quantized again at load", config.quant_method, len(requantized),
                       requantized[0], INT4_GROUP_SIZES)


def _nibbles_down(packed: torch.Tensor) -> torch.Tensor:
    """int32 `[R, C]` with 8 values down each column -> uint8 `[8R, C]` (value k of row r at bits 4k: row 8r + k)."""
    rows, cols = packed.shape
    return ((packed[:, None, :] >> _SHIFTS[None, :, None]) & 15).to(torch.uint8).view(rows * 8, cols)


def _nibbles_across(packed: torch.Tensor) -> torch.Tensor:
    """int32 `[R, C]` with 8 values along each row -> uint8 `[R, 8C]` (value k of column c at bits 4k: 8c + k)."""
    rows, cols = packed.shape
    return ((packed[:, :, None] >> _SHIFTS) & 15).to(torch.uint8).view(rows, cols * 8)


def grouped_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, g_idx: torch.Tensor | None,
                 name: str) -> Int4Weight | torch.Tensor:
    """w[o, i] = (q[o, i] - zero[o, g]) * scale[o, g], g = g_idx[i] (None: i // group size), as an `Int4Weight`
    where each run of group-size columns shares one group (minimum = -zero * scale, exact in fp32), else the
    dequantized fp32 weight. q uint8 `[out, in]`; scale, zero `[out, groups]`."""
    out_features, in_features = q.shape
    group_size = in_features // scale.shape[1]
    scale, zero = scale.float(), zero.float()
    if g_idx is not None:
        g_idx = g_idx.long()
        if g_idx.shape != (in_features,) or g_idx.min() < 0 or g_idx.max() >= scale.shape[1]:
            raise ValueError(f"{name}: g_idx must give each of the {in_features} input columns one of "
                             f"{scale.shape[1]} groups")
    if group_size in INT4_GROUP_SIZES and in_features % group_size == 0 and scale.shape[1] * group_size == in_features:
        runs = (g_idx if g_idx is not None else torch.arange(in_features) // group_size).view(-1, group_size)
        if bool((runs == runs[:, :1]).all()):
            first = runs[:, 0]
            s, z = scale[:, first], zero[:, first]
            return Int4Weight(q, s.contiguous(), (-z * s).contiguous())
    columns = g_idx if g_idx is not None else torch.arange(in_features) // group_size
    return (q.float() - zero[:, columns]) * scale[:, columns]


def _gptq(parts: dict[str, torch.Tensor], config: HfQuantConfig, name: str) -> Int4Weight | torch.Tensor:
    """qweight int32 `[in/8, out]` (8 inputs per int32), qzeros int32 `[groups, out/8]` (v1: zero - 1), scales
    `[groups, out]`, g_idx `[in]`."""
    q = _nibbles_down(parts["qweight"]).t()
    zero = _nibbles_across(parts["qzeros"])[:, :q.shape[0]].int() + config.zero_offset
    return grouped_int4(q.contiguous(), parts["scales"].t(), zero.t(), parts.get("g_idx"), name)


def _awq(parts: dict[str, torch.Tensor], config: HfQuantConfig, name: str) -> Int4Weight | torch.Tensor:
    """qweight int32 `[in, out/8]` and qzeros int32 `[groups, out/8]` in AWQ's nibble order, scales `[groups, out]`."""

    def outputs(packed: torch.Tensor) -> torch.Tensor:
        values = _nibbles_across(packed).view(packed.shape[0], -1, 8)
        return values[..., list(AWQ_ORDER)].reshape(packed.shape[0], -1)

    q = outputs(parts["qweight"]).t().contiguous()
    return grouped_int4(q, parts["scales"].t(), outputs(parts["qzeros"]).t(), None, name)


def _pack_quantized(parts: dict[str, torch.Tensor], config: HfQuantConfig, name: str) -> Int4Weight | torch.Tensor:
    """weight_packed int32 `[out, in/8]` (signed values + 8), weight_scale `[out, groups]`, weight_zero_point
    (asymmetric) int32 `[out/8, groups]` packed down the outputs, signed + 8."""
    out_features, in_features = (int(d) for d in parts["weight_shape"])
    q = _nibbles_across(parts["weight_packed"])[:, :in_features].contiguous()
    scale = parts["weight_scale"]
    zero = torch.full(scale.shape, 8, dtype=torch.int32)  # signed q - zero = (q + 8) - (zero + 8)
    if "weight_zero_point" in parts:
        zero = _nibbles_down(parts["weight_zero_point"])[:out_features].int()
    return grouped_int4(q, scale, zero, parts.get("weight_g_idx"), name)


def _int_quantized(parts: dict[str, torch.Tensor], config: HfQuantConfig, name: str) -> Int8Weight:
    if "weight_zero_point" in parts and bool(parts["weight_zero_point"].any()):
        raise ValueError(f"{name}: int8 weights with a nonzero zero point are not supported (symmetric only)")
    return Int8Weight(parts["weight"], parts["weight_scale"].float().reshape(-1).contiguous())


_UNPACK = {"gptq": _gptq, "awq": _awq, "pack-quantized": _pack_quantized, "int-quantized": _int_quantized}
