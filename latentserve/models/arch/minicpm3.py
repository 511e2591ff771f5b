"""MiniCPM3 (minicpm3): DeepSeek-V2's attention with rotate-half RoPE (LongRoPE in the published model) over dense
MLPs; embeddings times `scale_emb`, each sublayer's output times `scale_depth / sqrt(num_hidden_layers)` before its
residual, the final hidden states divided by `hidden_size / dim_model_base` before the head, tied by default."""
from __future__ import annotations

import math
from typing import Any

from latentserve.models.arch.base import Architecture
from latentserve.models.fields import Fields

# Llama's config underneath: no experts (fields a config still carries are not read).
_MOE_FIELDS = ("n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size")


class MiniCPM3(Architecture):
    model_type = "minicpm3"
    architectures = ("MiniCPM3ForCausalLM",)
    summary = "MiniCPM3: dense, LongRoPE, scaled embeddings, residuals and logits, tied head"
    defaults = {"scoring_func": "softmax", "topk_method": "greedy", "norm_topk_prob": False,
                "max_position_embeddings": 32768}

    def normalize(self, raw: dict[str, Any]) -> dict[str, Any]:
        raw = {k: v for k, v in raw.items() if k not in _MOE_FIELDS}
        if raw.get("v_head_dim") is None and isinstance(raw.get("hidden_size"), int) and isinstance(
                raw.get("num_attention_heads"), int):
            raw["v_head_dim"] = raw["hidden_size"] // raw["num_attention_heads"]  # transformers' default
        return raw

    def fields(self, f: Fields, parsed: dict[str, Any]) -> dict[str, Any]:
        layers, hidden = parsed["num_hidden_layers"], parsed["hidden_size"]
        # null scale_depth or dim_model_base: no scaling (transformers' sqrt(num_hidden_layers) and hidden_size)
        scale_depth = f.float("scale_depth", 1.4) if f.raw.get("scale_depth", 1.4) is not None else math.sqrt(layers)
        base = f.int("dim_model_base", 256) if f.raw.get("dim_model_base", 256) is not None else hidden
        return {
            "rope_style": "neox", "mlp_bias": f.bool("mlp_bias", False),
            "tie_word_embeddings": f.bool("tie_word_embeddings", True),
            "rms_norm_eps": f.float("rms_norm_eps", 1e-5),
            "embedding_scale": f.float("scale_emb", 12.0),
            "residual_scale": scale_depth / math.sqrt(layers),
            "logits_scaling": hidden / base,
        }
