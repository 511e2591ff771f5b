"""Youtu-LLM (youtu): DeepSeek-V3's attention over dense MLPs in every layer, the head tied to the embedding by
default."""
from __future__ import annotations

from typing import Any

from latentserve.models.arch.base import V3_DEFAULTS, Architecture
from latentserve.models.fields import Fields

# transformers' Youtu config has no experts: these fields, where a config still carries them, are not read.
_MOE_FIELDS = ("n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size", "n_group",
               "topk_group", "first_k_dense_replace", "routed_scaling_factor", "norm_topk_prob")


class Youtu(Architecture):
    model_type = "youtu"
    architectures = ("YoutuForCausalLM",)
    summary = "Youtu-LLM: DeepSeek-V3 attention, dense MLPs only, tied embeddings"
    defaults = {**V3_DEFAULTS, "max_position_embeddings": 131072}

    def normalize(self, raw: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in raw.items() if k not in _MOE_FIELDS}

    def fields(self, f: Fields, parsed: dict[str, Any]) -> dict[str, Any]:
        return {**super().fields(f, parsed), "tie_word_embeddings": f.bool("tie_word_embeddings", True)}
