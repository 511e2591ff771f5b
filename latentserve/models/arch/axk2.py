"""A.X K2 (axk2): DeepSeek-V3.2's sparse attention (an indexer on every layer) with one fused projection from q's
LoRA to the query and a sigmoid gate on the attention output (`QGateAttention`), gated RMSNorms on every layer's
input and on the MoE layers' MLP input (`GatedRMSNorm`), and routing over all experts unless the config sets
expert groups (A.X K2 Light sets none)."""
from __future__ import annotations

from typing import Any

from latentserve.models.arch.base import V3_DEFAULTS, mlp_layer_types
from latentserve.models.arch.deepseek_v32 import DeepseekV32
from latentserve.models.fields import Fields


class AXK2(DeepseekV32):
    model_type = "axk2"
    architectures = ("AXK2ForCausalLM",)
    summary = "A.X K2: DSA with a fused query and output-gate projection, gated RMSNorms"
    defaults = {**V3_DEFAULTS, "max_position_embeddings": 131072}
    index_n_heads = 16

    def normalize(self, raw: dict[str, Any]) -> dict[str, Any]:
        if raw.get("n_group") is None and raw.get("topk_group") is None:
            return {**raw, "n_group": 1, "topk_group": 1}  # routing without groups: one group of all experts
        if raw.get("n_group") is None or raw.get("topk_group") is None:
            raise ValueError("config.json: fields 'n_group' and 'topk_group' must be set together (or neither), got "
                             f"{raw.get('n_group')!r} and {raw.get('topk_group')!r}")
        return raw

    def fields(self, f: Fields, parsed: dict[str, Any]) -> dict[str, Any]:
        types = mlp_layer_types(f, parsed["num_hidden_layers"], f.int("first_k_dense_replace", 1, minimum=0),
                                f.int("moe_layer_freq", 1))
        return {**super().fields(f, parsed), "mlp_layer_types": types, "q_output_gate": True,
                "gated_norm_rank": f.int("gated_norm_rank", 16)}
