"""Kimi-Linear (kimi_linear): a hybrid of Kimi Delta Attention layers (linear attention, a state per request:
attention/linear/) and MLA layers without positions, over DeepSeek-V3's routed MoE (docs/hybrids.md)."""
from __future__ import annotations

import re
from typing import Any

from latentserve.config import LinearAttentionConfig
from latentserve.models.arch.base import Architecture, Tensors, mlp_layer_types
from latentserve.models.fields import Fields

# The checkpoints' own spellings of DeepSeek's config fields (transformers writes them so too; Ling's as well).
RENAMED_FIELDS = {"num_experts": "n_routed_experts", "num_experts_per_token": "num_experts_per_tok",
            "num_expert_group": "n_group", "moe_renormalize": "norm_topk_prob",
            "num_shared_experts": "n_shared_experts", "model_max_length": "max_position_embeddings"}
_EXPERT = re.compile(r"(model\.layers\.\d+)\.block_sparse_moe\.(.*)")
_EXPERT_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
LAYER_TYPES = ("full_attention", "linear_attention")


def renamed_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """config.json with the Kimi/Ling names of DeepSeek's fields (RENAMED_FIELDS) spelt DeepSeek's way."""
    out = dict(raw)
    for old, new in RENAMED_FIELDS.items():
        if old in out and new not in out:
            out[new] = out.pop(old)
    return out


class KimiLinear(Architecture):
    model_type = "kimi_linear"
    architectures = ("KimiLinearForCausalLM",)
    summary = "Kimi-Linear: Kimi Delta Attention layers (a state per request) and MLA without rope, V3 MoE"
    defaults = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
                "max_position_embeddings": 1048576}

    def normalize(self, raw: dict[str, Any]) -> dict[str, Any]:
        return renamed_fields(raw)

    def fields(self, f: Fields, parsed: dict[str, Any]) -> dict[str, Any]:
        num_layers = parsed["num_hidden_layers"]
        first_dense = f.int("first_k_dense_replace", 1, minimum=0)  # transformers' default for this family
        linear = f.raw.get("linear_attn_config") or {}
        if not isinstance(linear, dict):
            raise ValueError(f"config.json: field 'linear_attn_config' must be an object, got {linear!r}")
        lf = Fields(linear, where="config.json linear_attn_config")
        return {
            # No rope: the "rope" dims of q and k attend unrotated (ModelConfig.rope_free); neox rotates in place.
            "rope_style": "neox", "rope_free": True, "mlp_bias": False, "first_k_dense_replace": first_dense,
            "mlp_layer_types": mlp_layer_types(f, num_layers, first_dense, f.int("moe_layer_freq", 1)),
            "layer_types": _layer_types(f, linear, num_layers),
            "linear_attention": LinearAttentionConfig(
                num_heads=lf.int("num_heads", f.int("linear_num_heads", 32)),
                head_dim=lf.int("head_dim", f.int("linear_head_dim", 128)),
                conv_kernel_size=lf.int("short_conv_kernel_size", f.int("linear_conv_kernel_dim", 4)),
            ),
        }

    def checkpoint_tensors(self, config, tensors: Tensors) -> Tensors:
        for name, tensor in tensors:
            match = _EXPERT.fullmatch(name)
            if match is not None:
                rest = re.sub(r"^(experts\.\d+)\.(w[123])\.", lambda m: f"{m[1]}.{_EXPERT_PARTS[m[2]]}.", match[2])
                name = f"{match[1]}.mlp.{rest}"
            yield name, tensor


def _layer_types(f: Fields, linear: dict, num_layers: int) -> tuple[str, ...]:
    """Each layer's attention: config.json's `layer_types`, else linear_attn_config's 1-based `full_attn_layers` and
    `kda_layers`, else transformers' default (MLA at every 4th layer but the first)."""
    types = f.raw.get("layer_types")
    if types is None and "full_attn_layers" in linear and "kda_layers" in linear:
        types = [None] * num_layers
        for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
            for layer in linear[key]:
                if not isinstance(layer, int) or not 1 <= layer <= num_layers:
                    raise ValueError(f"config.json linear_attn_config: field {key!r} must list layers 1.."
                                     f"{num_layers}, got {linear[key]!r}")
                types[layer - 1] = kind
    if types is None:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(num_layers)]
    return checked_layer_types(types, num_layers)


def checked_layer_types(types: Any, num_layers: int) -> tuple[str, ...]:
    if not isinstance(types, list) or len(types) != num_layers or not set(types) <= set(LAYER_TYPES):
        raise ValueError(f"config.json: 'layer_types' must give one of {LAYER_TYPES} for each of the {num_layers} "
                         f"layers, got {types!r}")
    return tuple(types)
