"""Mistral 4 (mistral4, the text model): DeepSeek-V3's attention and MoE with softmax routing whose groups are scored
by their best two experts, every layer an MoE by default, Llama 4's position-dependent query scaling on YaRN, and the
routed experts stored as two 3-D tensors per layer."""
from __future__ import annotations

import math
import re
from typing import Any

import torch

from latentserve.models.arch.base import Architecture, Tensors
from latentserve.models.fields import Fields

_FUSED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


class Mistral4(Architecture):
    model_type = "mistral4"
    architectures = ("Mistral4ForCausalLM",)
    summary = "Mistral 4: softmax group routing, Llama 4 query scaling on YaRN, 3-D expert tensors"
    defaults = {"scoring_func": "softmax", "topk_method": "group_limited_top2", "norm_topk_prob": True,
                "max_position_embeddings": 1048576}

    def normalize(self, raw: dict[str, Any]) -> dict[str, Any]:
        # Its rope_parameters give the rope dims as a share of the whole query/key head (transformers' head_dim):
        # exactly qk_rope_head_dim, which the generic parser expects as a factor of 1.
        params = raw.get("rope_parameters")
        if not isinstance(params, dict) or "partial_rotary_factor" not in params:
            return raw
        rope, nope = raw.get("qk_rope_head_dim"), raw.get("qk_nope_head_dim")
        if not (isinstance(rope, int) and isinstance(nope, int)
                and math.isclose(params["partial_rotary_factor"], rope / (rope + nope))):
            return raw  # the generic parser names the field
        return {**raw, "rope_parameters": {k: v for k, v in params.items() if k != "partial_rotary_factor"}}

    def fields(self, f: Fields, parsed: dict[str, Any]) -> dict[str, Any]:
        params = Fields(f.raw.get("rope_parameters") or {}, where="config.json rope_parameters")
        return {**super().fields(f, parsed), "rms_norm_eps": f.float("rms_norm_eps", 1e-6),
                "llama4_scaling_beta": params.float("llama_4_scaling_beta", None, positive=False)}

    def checkpoint_tensors(self, config, tensors: Tensors) -> Tensors:
        """Each layer's `experts.gate_up_proj` `[E, 2I, H]` (gate rows, then up rows) and `experts.down_proj`
        `[E, H, I]` as the per-expert weights the core loads."""
        for name, tensor in tensors:
            match = _FUSED_EXPERTS.match(name)
            if match is None:
                yield name, tensor
                continue
            prefix, kind = match[1], match[2]
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"{name} is stored quantized: Mistral 4's 3-D expert tensors load in full precision")
            for e, weight in enumerate(tensor.unbind(0)):
                if kind == "down_proj":
                    yield f"{prefix}.{e}.down_proj.weight", weight
                else:
                    gate, up = weight.chunk(2, dim=0)
                    yield f"{prefix}.{e}.gate_proj.weight", gate
                    yield f"{prefix}.{e}.up_proj.weight", up
