"""Kimi-K2.5 (kimi_k25), its text model: DeepSeek-V3 (`text_config`) inside a vision wrapper. The vision tower and
projector are not loaded (latentserve takes text only); the head is tied to the embedding as the wrapper's
`tie_word_embeddings` says (transformers' default: tied)."""
from __future__ import annotations

import re
from typing import Any

from latentserve.models.arch.base import Architecture, Tensors
from latentserve.models.fields import Fields

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_BLOCKS = re.compile(r"^model\.blocks\.")


class KimiK25(Architecture):
    model_type = "kimi_k25"
    architectures = ("Kimi_K25ForConditionalGeneration", "KimiK25ForConditionalGeneration")
    summary = "Kimi-K2.5: the DeepSeek-V3 text model of its vision wrapper (text only)"

    def normalize(self, raw: dict[str, Any]) -> dict[str, Any]:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"config.json: field 'text_config' must be an object, got {text!r}")
        fields = {k: v for k, v in text.items() if k not in ("architectures", "model_type")}
        wrapper = {k: raw[k] for k in ("architectures", "model_type", "quantization_config") if k in raw}
        return {**fields, **wrapper, "tie_word_embeddings": Fields(raw).bool("tie_word_embeddings", True)}

    def checkpoint_tensors(self, config, tensors: Tensors) -> Tensors:
        for name, tensor in tensors:
            if name.startswith("language_model.lm_head."):
                if config.tie_word_embeddings:
                    continue  # tied: transformers reads the embedding
                name = name.removeprefix("language_model.")
            elif name.startswith("language_model.model."):
                # transformers' save_pretrained writes the text layers as `blocks` (its renaming of the vision
                # tower's reversed), the published checkpoints as `layers`
                name = _BLOCKS.sub("model.layers.", name.removeprefix("language_model."))
                layer = _LAYER.match(name)
                if layer is not None and int(layer[1]) >= config.num_hidden_layers:
                    continue  # its MTP layers: not run
            else:
                continue  # the vision tower and projector
            yield name, tensor
