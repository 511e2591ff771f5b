"""`Architecture`: what one MLA model family needs beyond the shared core (models/deepseek.py), in one place.

An adapter says which `config.json` it reads (`model_type`, `architectures`), the defaults transformers gives the
fields a config may omit, the `ModelConfig` fields it sets itself (its module variants: the rope layout, which layers
are dense, an MoE output norm, ...), and how its checkpoint's tensor names map onto the core's. The engine never asks
which architecture it runs: the model is built from the `ModelConfig` alone.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from latentserve.models.fields import Fields

if TYPE_CHECKING:
    from latentserve.models.config import ModelConfig

Tensors = Iterator[tuple[str, torch.Tensor]]

# transformers' DeepSeek-V3 defaults, which most of the family inherits.
V3_DEFAULTS: Mapping[str, Any] = {
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True, "max_position_embeddings": 4096,
}


class Architecture:
    """One model family; subclasses override what differs from DeepSeek-V3."""

    model_type: str = ""  # config.json's `model_type`
    architectures: tuple[str, ...] = ()  # the `architectures` names its config.json may carry
    summary: str = ""  # one line for `latentserve backends` and the docs
    defaults: Mapping[str, Any] = V3_DEFAULTS

    def normalize(self, raw: dict[str, Any]) -> dict[str, Any]:
        """config.json as the generic parser reads it: this family's own field names, legacy spellings or wrapper
        (Kimi-K2.5's text_config) mapped onto DeepSeek's fields, and fields it does not have dropped."""
        return raw

    def fields(self, f: Fields, parsed: dict[str, Any]) -> dict[str, Any]:
        """`ModelConfig` fields this architecture sets itself, given the generic ones (`parsed`); they override
        those."""
        return {"rope_style": "interleave" if f.bool("rope_interleave", True) else "neox", "mlp_bias": False}

    def checkpoint_tensors(self, config: ModelConfig, tensors: Tensors) -> Tensors:
        """The checkpoint's tensors under the core's names (DeepSeek's), converted where the layout differs; a
        tensor the model has no use for is dropped here, by name."""
        return tensors

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.model_type!r})"


def mlp_layer_types(f: Fields, num_layers: int, first_dense: int, freq: int = 1) -> tuple[str, ...]:
    """config.json's `mlp_layer_types` ("dense" or "sparse" per layer), or, where it has none, `first_dense` dense
    layers and then every `freq`-th one sparse (transformers' default for the families that list them)."""
    types = f.raw.get("mlp_layer_types")
    if types is None:
        return tuple("sparse" if i >= first_dense and i % freq == 0 else "dense" for i in range(num_layers))
    if not isinstance(types, list) or len(types) != num_layers or not set(types) <= {"dense", "sparse"}:
        raise ValueError(f"{f.where}: field 'mlp_layer_types' must list 'dense' or 'sparse' for each of the "
                         f"{num_layers} layers, got {types!r}")
    return tuple(types)
