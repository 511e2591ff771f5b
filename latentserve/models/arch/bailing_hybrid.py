"""Ling / Ring hybrids (bailing_hybrid): Kimi Delta Attention layers with single-projection gates and a bounded
("safe") decay, every `layer_group_size`-th layer MLA with a head-wise output gate, over DeepSeek-V3's routed MoE
(docs/hybrids.md)."""
from __future__ import annotations

import re
from typing import Any

from latentserve.config import LinearAttentionConfig
from latentserve.models.arch.base import Architecture, Tensors, mlp_layer_types
from latentserve.models.arch.kimi_linear import checked_layer_types, renamed_fields
from latentserve.models.fields import Fields

_NAMES = ((re.compile(r"^model\.word_embeddings\."), "model.embed_tokens."),
          (re.compile(r"\.attention\.dense\."), ".self_attn.o_proj."),
          (re.compile(r"\.attention\."), ".self_attn."),
          (re.compile(r"\.mlp\.gate\.expert_bias$"), ".mlp.gate.e_score_correction_bias"))


class BailingHybrid(Architecture):
    model_type = "bailing_hybrid"
    architectures = ("BailingHybridForCausalLM",)
    summary = "Ling/Ring hybrids: gated-decay KDA layers (a state per request) and output-gated MLA, V3 MoE"
    defaults = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
                "max_position_embeddings": 262144}

    def normalize(self, raw: dict[str, Any]) -> dict[str, Any]:
        return renamed_fields(raw)

    def fields(self, f: Fields, parsed: dict[str, Any]) -> dict[str, Any]:
        num_layers = parsed["num_hidden_layers"]
        for name in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):
            if any(f.raw.get(name) or ()):
                raise ValueError(f"config.json: field {name!r} clips the SwiGLU of some layers; latentserve's MoE "
                                 f"does not clip (all limits must be 0), got {f.raw[name]!r}")
        first_dense = f.int("first_k_dense_replace", 2, minimum=0)  # transformers' default for this family
        group = f.int("layer_group_size", 6)
        types = f.raw.get("layer_types")
        if types is None:
            types = ["full_attention" if (i + 1) % group == 0 else "linear_attention" for i in range(num_layers)]
        # transformers reads the linear layers' head width from `head_dim` (it then stores the rope width there).
        head_dim = f.int("linear_head_dim", None) or f.int("head_dim", 128)
        return {
            "rope_style": "interleave", "mlp_bias": False, "first_k_dense_replace": first_dense,
            "mlp_layer_types": mlp_layer_types(f, num_layers, first_dense),
            "layer_types": checked_layer_types(types, num_layers),
            "head_output_gate": True,
            "linear_attention": LinearAttentionConfig(
                num_heads=f.int("linear_num_heads", None) or parsed["num_attention_heads"],
                head_dim=head_dim,
                conv_kernel_size=f.int("linear_conv_kernel_dim", None) or f.int("short_conv_kernel_size", 4),
                gate_lora=False,
                gate_lower_bound=f.float("kda_lower_bound", -5.0, positive=False) if f.bool("kda_safe_gate", True)
                else None,
            ),
        }

    def checkpoint_tensors(self, config, tensors: Tensors) -> Tensors:
        heads = config.linear_attention.num_heads
        for name, tensor in tensors:
            for pattern, replacement in _NAMES:
                name = pattern.sub(replacement, name)
            if name.endswith(".self_attn.A_log"):
                tensor = tensor.reshape(1, 1, heads, 1)  # stored per head; the layer keeps Kimi's layout
            yield name, tensor
