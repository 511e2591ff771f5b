"""Weight formats: a DeepSeek FP8 checkpoint as published, and int8 / int4 quantization at load."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("fp8", "int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128)
FP8_SUPPORTED = {"quant_method": ("fp8",), "fmt": ("e4m3",), "activation_scheme": ("dynamic",)}


@dataclass(frozen=True)
class Fp8Config:
    """config.json `quantization_config` of DeepSeek's block-wise FP8 (V3, R1, Kimi-K2): float8_e4m3fn weights with
    one float32 `weight_scale_inv` per `weight_block_size` block."""

    weight_block_size: tuple[int, int] = (128, 128)

    @classmethod
    def from_dict(cls, raw: Any) -> Fp8Config:
        where = "config.json quantization_config"
        if not isinstance(raw, dict):
            raise ValueError(f"{where} must be an object, got {raw!r}")
        for field, supported in FP8_SUPPORTED.items():
            value = raw.get(field, supported[0] if field != "quant_method" else None)
            if value not in supported:
                raise ValueError(f"{where}: field {field!r} is {value!r}; supported: {list(supported)}")
        block = raw.get("weight_block_size")
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ValueError(
                f"{where}: field 'weight_block_size' must be two positive ints [rows, cols] (DeepSeek publishes "
                f"[128, 128]), got {block!r}"
            )
        return cls(tuple(block))


@dataclass(frozen=True)
class PrequantizedConfig:
    """A checkpoint whose linear weights are stored quantized in a format the loader unpacks into latentserve's int4
    or int8 layout (models/formats/: GPTQ, AWQ, compressed-tensors, GGUF)."""

    quant_method: str  # the checkpoint's name for its format ("gptq", "awq", "compressed-tensors", "gguf")
    method: str  # what its weights unpack into: "int4" or "int8"
    group_size: int | None = None  # int4: the checkpoint's group size


@dataclass(frozen=True)
class QuantConfig:
    """Quantization of linear weights at load: "int8" per output channel, "int4" per group of input columns."""

    method: str
    group_size: int | None = None  # int4 only; None: per layer, the largest of INT4_GROUP_SIZES dividing its input
    # Quantize the output projection too (vLLM's `lm_head_quantized`); LLM(...) turns it on, as llama.cpp does.
    lm_head: bool = False

    def __post_init__(self) -> None:
        if self.method not in ("int8", "int4"):
            raise ValueError(f"load-time quantization must be 'int8' or 'int4', got {self.method!r}")
        if self.method == "int4":
            if self.group_size is not None and self.group_size not in INT4_GROUP_SIZES:
                raise ValueError(f"quantization_group_size must be one of {INT4_GROUP_SIZES}, got {self.group_size!r}")
        elif self.group_size is not None:
            raise ValueError(f"quantization_group_size applies to int4 only, not to {self.method!r}")


def int4_group(config: QuantConfig, name: str, in_features: int) -> int:
    """The int4 group size of layer `name`: the one asked for, else the largest of INT4_GROUP_SIZES that divides
    its input (128 where it can, as GPTQ and AWQ checkpoints mostly are: 5 % fewer bytes than 64 and 6-12 % faster
    decode products, at the same accuracy on the embedded model; V2-Lite's dense 10944 columns take 64)."""
    sizes = INT4_GROUP_SIZES if config.group_size is None else (config.group_size,)
    for size in sorted(sizes, reverse=True):
        if in_features % size == 0:
            return size
    if config.group_size is None:
        raise ValueError(f"{name}: int4 needs input columns in multiples of {min(INT4_GROUP_SIZES)}; it has "
                         f"{in_features}")
    raise ValueError(f"{name}: int4 group size {config.group_size} does not divide its {in_features} input columns; "
                     f"choose a quantization_group_size that does")


def resolve_quantization(
    requested: str | None, group_size: int | None, checkpoint: Fp8Config | PrequantizedConfig | None,
    lm_head_quantized: bool | None = None
) -> QuantConfig | None:
    """The load-time quantization for a user's `quantization` on a checkpoint stored as `checkpoint` (None: plain).

    An FP8 checkpoint is always dequantized as published; "int8"/"int4" then re-quantize it (they win), and "fp8"
    only confirms what config.json says. A GPTQ/AWQ/compressed-tensors/GGUF checkpoint loads in its own int4/int8
    (None or that method), or is dequantized and quantized to the other. `lm_head_quantized` (None: yes) applies
    to int8/int4 only."""
    if requested is not None and requested not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {requested!r}; use one of: {', '.join(QUANTIZATIONS)} (or None)")
    if lm_head_quantized not in (None, True, False):
        raise ValueError(f"lm_head_quantized must be True, False or None, got {lm_head_quantized!r}")
    if requested == "fp8" and not isinstance(checkpoint, Fp8Config):
        stored = f"stored as {checkpoint.quant_method}" if checkpoint is not None else "not quantized"
        raise ValueError(
            "quantization='fp8' needs a DeepSeek FP8 checkpoint (config.json quantization_config with quant_method "
            f"'fp8'); this checkpoint is {stored}: use 'int8' or 'int4'"
        )
    if isinstance(checkpoint, PrequantizedConfig):
        method = requested or checkpoint.method
        if method != checkpoint.method:
            logger.info("%s checkpoint (%s weights) with quantization=%r: its weights are dequantized, then "
                        "quantized to %s", checkpoint.quant_method, checkpoint.method, requested, requested)
        return QuantConfig(method, group_size, lm_head=lm_head_quantized is not False)
    if requested in (None, "fp8"):
        if group_size is not None:
            raise ValueError("quantization_group_size applies to quantization='int4' only")
        if lm_head_quantized is not None:
            raise ValueError("lm_head_quantized applies to quantization='int8' or 'int4' only")
        return None
    if checkpoint is not None:
        logger.info("FP8 checkpoint with quantization=%r: its weights are dequantized, then quantized to %s",
                    requested, requested)
    return QuantConfig(requested, group_size, lm_head=lm_head_quantized is not False)
