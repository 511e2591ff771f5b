"""Checkpoint formats beyond plain safetensors: quantized Hugging Face checkpoints (hf_quant.py) and GGUF files
(gguf.py). Each turns its format into what the loader takes: config.json fields, and (name, tensor) pairs under the
Hugging Face names, a quantized layer's weight unpacked into latentserve's int4 / int8 layout."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from latentserve.layers.quant.config import Fp8Config, PrequantizedConfig
from latentserve.models.formats.gguf import is_gguf, open_gguf
from latentserve.models.formats.hf_quant import HF_QUANT_METHODS, parse_hf_quant

GGUF_METHOD = "gguf"


def model_folder(path: str | Path) -> Path:
    """The checkpoint folder `--model path` stands for: the path itself, or for a GGUF file the folder of its
    config and tokenizer that gguf.py writes."""
    path = Path(path)
    return open_gguf(path) if is_gguf(path) else path


def checkpoint_quantization(raw: Any) -> Fp8Config | PrequantizedConfig:
    """config.json's `quantization_config`: DeepSeek's FP8, a GPTQ/AWQ/compressed-tensors format, or (in the folder
    gguf.py writes for a GGUF file) the int4/int8 its weights unpack into."""
    if not isinstance(raw, dict):
        raise ValueError(f"config.json quantization_config must be an object, got {raw!r}")
    method = raw.get("quant_method")
    if method in HF_QUANT_METHODS:
        return parse_hf_quant(raw)
    if method == GGUF_METHOD:
        return PrequantizedConfig(GGUF_METHOD, raw["method"])
    if method == "fp8":
        return Fp8Config.from_dict(raw)
    supported = ["fp8", *HF_QUANT_METHODS]
    raise ValueError(f"config.json quantization_config: field 'quant_method' is {method!r}; supported: {supported}")
