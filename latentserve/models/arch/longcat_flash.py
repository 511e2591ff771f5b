"""LongCat-Flash (longcat_flash): each layer two MLA + dense MLP sublayers and a shortcut MoE
(`ShortcutMoEDecoderLayer`); softmax routing steered by a correction bias, over experts of which the last
`zero_expert_num` are zero-compute identities (`ZeroExpertMoE`), weights not normalized; the query and the normed
latent scaled by sqrt(hidden_size / their LoRA rank), folded into q_b_proj and kv_a_layernorm at load."""
from __future__ import annotations

import math
import re
from typing import Any

import torch

from latentserve.models.arch.base import Architecture, Tensors
from latentserve.models.fields import Fields

_RENAMES = [
    (re.compile(r"\.mlp\.router\.classifier\."), ".mlp.gate."),
    (re.compile(r"\.mlp\.router\.e_score_correction_bias$"), ".mlp.gate.e_score_correction_bias"),
    (re.compile(r"\.self_attn\.(\d+)\.kv_b_proj\."), r".self_attn.\1.attn.kv_b_proj."),
]


class LongcatFlash(Architecture):
    model_type = "longcat_flash"
    architectures = ("LongcatFlashForCausalLM",)
    summary = "LongCat-Flash: two attention+MLP sublayers per layer with a shortcut MoE, zero-compute experts"
    defaults = {"scoring_func": "softmax", "topk_method": "noaux_tc", "norm_topk_prob": False,
                "max_position_embeddings": 131072}

    def normalize(self, raw: dict[str, Any]) -> dict[str, Any]:
        """Its own field names onto the generic ones (one routing group, no shared experts)."""
        f = Fields(raw)
        if f.bool("router_bias", False):
            raise ValueError("config.json: field 'router_bias' true (a biased LongCat-Flash router) is not supported")
        if "num_layers" not in raw:
            raise ValueError("config.json: missing required field 'num_layers'")
        zero = f.int("zero_expert_num", 0, minimum=0)
        mapped = {
            "num_hidden_layers": raw["num_layers"], "intermediate_size": raw.get("ffn_hidden_size"),
            "moe_intermediate_size": raw.get("expert_ffn_hidden_size"), "num_experts_per_tok": raw.get("moe_topk"),
            "n_routed_experts": f.int("n_routed_experts") + zero, "n_shared_experts": 0, "n_group": 1,
            "topk_group": 1, "zero_expert_num": zero,
        }
        params = raw.get("rope_parameters") or raw.get("rope_scaling")
        if raw.get("rope_theta") is None and not (isinstance(params, dict) and "rope_theta" in params):
            mapped["rope_theta"] = 10000000.0  # transformers' default for this model
        return {**raw, **mapped}

    def fields(self, f: Fields, parsed: dict[str, Any]) -> dict[str, Any]:
        # transformers rotates interleaved pairs whatever rope_interleave says
        return {"rope_style": "interleave", "mlp_bias": False, "rms_norm_eps": f.float("rms_norm_eps", 1e-5),
                "shortcut_moe": True, "zero_expert_num": f.int("zero_expert_num", 0, minimum=0)}

    def checkpoint_tensors(self, config, tensors: Tensors) -> Tensors:
        q_scale = math.sqrt(config.hidden_size / config.q_lora_rank)
        kv_scale = math.sqrt(config.hidden_size / config.kv_lora_rank)
        for name, tensor in tensors:
            if name.startswith("model.mtp."):
                continue  # its multi-token-prediction module: not run
            for pattern, replacement in _RENAMES:
                name = pattern.sub(replacement, name)
            scale = q_scale if name.endswith(".q_b_proj.weight") else (
                kv_scale if name.endswith(".kv_a_layernorm.weight") else None)
            if scale is not None:
                if not isinstance(tensor, torch.Tensor):
                    raise ValueError(f"{name} is stored quantized: LongCat-Flash's LoRA scaling is folded into it at "
                                     "load, which needs it in full precision")
                tensor = (tensor.float() * scale).to(tensor.dtype)
            yield name, tensor
