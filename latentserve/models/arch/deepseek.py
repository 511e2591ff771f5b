"""DeepSeek-V2 / V2-Lite and DeepSeek-V3 / R1: the core as it is."""
from __future__ import annotations

from typing import Any

from latentserve.models.arch.base import Architecture
from latentserve.models.fields import Fields


class DeepseekV2(Architecture):
    model_type = "deepseek_v2"
    architectures = ("DeepseekV2ForCausalLM",)
    summary = "DeepSeek-V2, V2-Lite: softmax routing (greedy or group-limited), complex-pair RoPE"
    defaults = {"scoring_func": "softmax", "topk_method": "greedy", "norm_topk_prob": False,
                "max_position_embeddings": 2048}

    def fields(self, f: Fields, parsed: dict[str, Any]) -> dict[str, Any]:
        return {"rope_style": "gptj", "mlp_bias": f.bool("mlp_bias", False)}


class DeepseekV3(Architecture):
    model_type = "deepseek_v3"
    architectures = ("DeepseekV3ForCausalLM",)
    summary = "DeepSeek-V3, R1: sigmoid routing with correction bias and groups, FP8 checkpoints, MTP"
    # transformers' V3 MLP has no bias whatever the config says: the base adapter's `fields`.


class KimiK2(DeepseekV3):
    """Kimi-K2 as published: DeepSeek-V3 under its own model_type."""

    model_type = "kimi_k2"
    summary = "Kimi-K2: DeepSeek-V3 under its own model_type"
