"""GLM-4.7-Flash (glm4_moe_lite): DeepSeek-V3's attention and MoE, each layer's MLP kind listed in `mlp_layer_types`
(by default the first dense, the rest sparse), value heads wider than the no-rope query/key part."""
from __future__ import annotations

from typing import Any

from latentserve.models.arch.base import Architecture, mlp_layer_types
from latentserve.models.fields import Fields


class Glm4MoeLite(Architecture):
    model_type = "glm4_moe_lite"
    architectures = ("Glm4MoeLiteForCausalLM",)
    summary = "GLM-4.7-Flash: DeepSeek-V3 with listed dense/sparse layers, v_head_dim > qk_nope_head_dim"

    def fields(self, f: Fields, parsed: dict[str, Any]) -> dict[str, Any]:
        return {**super().fields(f, parsed), "rms_norm_eps": f.float("rms_norm_eps", 1e-5),
                "mlp_layer_types": mlp_layer_types(f, parsed["num_hidden_layers"], first_dense=1)}
