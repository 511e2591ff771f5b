"""Default sampling settings from a checkpoint's `generation_config.json`, as vLLM's `--generation-config` reads them.

"auto" reads the model folder's file (absent: no defaults), "vllm" ignores it, any other value is a folder that must
hold one. A request's own values always win; these only fill what it leaves unset.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# generation_config.json key -> SamplingParams field: the keys vLLM takes over, no others.
KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
FILE = "generation_config.json"


def generation_defaults(model_dir: str | Path, setting: str = "auto") -> dict[str, Any]:
    """The SamplingParams fields `setting` gives defaults for (maybe none)."""
    if setting == "vllm":
        return {}
    if setting == "auto":
        path = Path(model_dir) / FILE
        if not path.is_file():
            return {}
    else:
        path = Path(setting) / FILE
        if not path.is_file():
            raise ValueError(f"generation_config={setting!r}: no {FILE} there (use 'auto' for the model's own, "
                             "'vllm' for none, or a folder holding one)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return {field: config[key] for key, field in KEYS.items() if config.get(key) is not None}
