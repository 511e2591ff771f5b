"""A.X K1 (axk1): DeepSeek-V3 with an RMSNorm on each MoE's output (`NormedMoE`).

Its checkpoints store that norm per decoder layer (`model.layers.{i}.post_mlp_layernorm`), the published ones for
dense layers too, which do not use it; and they may route without a score correction bias (then zero, as in
transformers)."""
from __future__ import annotations

import re
from typing import Any

import torch

from latentserve.models.arch.base import Architecture, Tensors, mlp_layer_types
from latentserve.models.fields import Fields

_LAYER_NORM = re.compile(r"^model\.layers\.(\d+)\.post_mlp_layernorm\.")


class AXK1(Architecture):
    model_type = "axk1"
    architectures = ("AXK1ForCausalLM",)
    summary = "A.X K1: DeepSeek-V3 with an RMSNorm on the MoE output"

    def fields(self, f: Fields, parsed: dict[str, Any]) -> dict[str, Any]:
        types = mlp_layer_types(f, parsed["num_hidden_layers"], f.int("first_k_dense_replace", 1, minimum=0),
                                f.int("moe_layer_freq", 1))
        return {**super().fields(f, parsed), "mlp_layer_types": types, "moe_output_norm": True}

    def checkpoint_tensors(self, config, tensors: Tensors) -> Tensors:
        seen = set()
        for name, tensor in tensors:
            match = _LAYER_NORM.match(name)
            if match is not None:
                if not config.is_moe_layer(int(match[1])):
                    continue  # a dense layer's copy: unused
                name = name.replace(".post_mlp_layernorm.", ".mlp.post_mlp_layernorm.")
            seen.add(name)
            yield name, tensor
        for layer in range(config.num_hidden_layers):
            bias = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
            if config.is_moe_layer(layer) and bias not in seen:
                yield bias, torch.zeros(config.routing.n_routed_experts)
