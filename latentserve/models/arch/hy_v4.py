"""Hunyuan V4 (hy_v4): DeepSeek Sparse Attention with GLM-5's shared-selection layers, and on top of it

- an indexer rotating the last `qk_rope_head_dim` dims of its heads in pairs (`DSAConfig.rope_tail`), its key norm at
  `rms_norm_eps`;
- a learned sink logit per head in every attention softmax (`DSAConfig.attention_sinks`: the layers always attend
  through the sparse path);
- a sigmoid gate on the attention output, from the layer's input (`HiddenGateAttention`);
- hyper-connections: `hc_mult` residual streams (layers/hyper_connection.py);
- routed experts whose SwiGLU clamps gate and up at `swiglu_limit` (`GatedMLP`; 0 or below: no clamp).

The checkpoints' names differ from the core's (`linear_gate`, `learnable_sink_param`, `hc_pre.*`), and they stack
each layer's routed experts in two tensors (`mlp.experts.gate_up_proj` `[E, 2I, H]`, `down_proj` `[E, H, I]`),
which are split per expert here. Its MTP layers (`model.mtp_layers.*`) are not loaded."""
from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from latentserve.layers.hyper_connection import HyperConnectionConfig
from latentserve.models.arch.base import V3_DEFAULTS, Tensors, mlp_layer_types
from latentserve.models.arch.deepseek_v32 import DeepseekV32
from latentserve.models.fields import Fields

# In this order (transformers' own, which the two published layouts of the head's names rely on).
_RENAMES = [(re.compile(pattern), replacement) for pattern, replacement in (
    (r"\.hc_pre\.hc_", ".hc_"),
    (r"\.hc_attn_layer\.hc_(fn|base|scale)$", r".attn_hc.\1"),
    (r"\.hc_mlp_layer\.hc_(fn|base|scale)$", r".ffn_hc.\1"),
    (r"\.hc_head_(fn|base|scale)$", r".hc_\1"),
    (r"\.self_attn\.learnable_sink_param$", ".self_attn.attn.sinks"),  # (the sinks live in the attention core)
    (r"\.linear_gate\.", ".gate_proj."),
)]
_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


class HYV4(DeepseekV32):
    model_type = "hy_v4"
    architectures = ("HYV4ForCausalLM",)
    summary = ("Hunyuan V4: DSA with shared selections, tail-rope indexer, attention sinks, output gates, "
               "hyper-connections, clamped experts")
    defaults = {**V3_DEFAULTS, "max_position_embeddings": 262144}
    index_n_heads = 16
    interleaved_index_rope = True

    def normalize(self, raw: dict[str, Any]) -> dict[str, Any]:
        # One expert group by default (transformers' config): top-k over all experts.
        return {**raw, "n_group": raw.get("n_group") or 1, "topk_group": raw.get("topk_group") or 1}

    def fields(self, f: Fields, parsed: dict[str, Any]) -> dict[str, Any]:
        fields = super().fields(f, parsed)
        eps = parsed["rms_norm_eps"]
        fields["dsa"] = replace(fields["dsa"], rope_tail=True, k_norm_eps=eps, attention_sinks=True)
        limit = f.float("swiglu_limit", 10.0, positive=False)
        hc = HyperConnectionConfig(f.int("hc_mult", 4), f.float("hc_magnitude", 2.0), f.float("hc_eps", 1e-6), eps)
        return {**fields, "mlp_layer_types": mlp_layer_types(f, parsed["num_hidden_layers"], first_dense=1),
                "hidden_output_gate": True, "hyper_connections": hc, "swiglu_limit": limit if limit > 0 else None,
                "num_nextn_predict_layers": 0}

    def indexer_layers(self, f: Fields, num_layers: int) -> tuple[bool, ...]:
        """`indexer_types` ("full" / "shared" per layer), by default the first layer and every fourth from the
        second."""
        types = f.raw.get("indexer_types")
        if types is None:
            types = ["full" if i == 0 or (i - 1) % 4 == 0 else "shared" for i in range(num_layers)]
        if not isinstance(types, list) or len(types) != num_layers or not set(types) <= {"full", "shared"}:
            raise ValueError(f"{f.where}: field 'indexer_types' must list 'full' or 'shared' for each of the "
                             f"{num_layers} layers, got {types!r}")
        return tuple(t == "full" for t in types)

    def checkpoint_tensors(self, config, tensors: Tensors) -> Tensors:
        for name, tensor in tensors:
            if name.startswith("model.mtp_layers."):
                continue  # the MTP layers: not run
            for pattern, replacement in _RENAMES:
                name = pattern.sub(replacement, name)
            stacked = _STACKED.match(name)
            if stacked is None:
                yield name, tensor
                continue
            prefix, kind = stacked[1], stacked[2]
            for e, weight in enumerate(tensor):
                if kind == "down_proj":
                    yield f"{prefix}.{e}.down_proj.weight", weight
                else:
                    gate, up = weight.chunk(2)
                    yield f"{prefix}.{e}.gate_proj.weight", gate
                    yield f"{prefix}.{e}.up_proj.weight", up


class HYV4VL(HYV4):
    """Hunyuan V4 VL's language model, for text: the config's `text_config`, the checkpoint without its vision tower
    (`vit.*`). Its MRoPE rotates each section of the rope dims by one of three position ids; for text all three are
    the token's position, which is plain RoPE. Images and video are not supported."""

    model_type = "hy_v4_vl"
    architectures = ("HYV4VLForConditionalGeneration",)
    summary = "Hunyuan V4 VL, its language model on text (no vision tower)"
    index_n_heads = 32

    def normalize(self, raw: dict[str, Any]) -> dict[str, Any]:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"config.json: field 'text_config' must be an object, got {text!r}")
        outer = {k: raw[k] for k in ("architectures", "tie_word_embeddings", "quantization_config") if k in raw}
        return super().normalize({**text, **outer, "model_type": self.model_type})

    def checkpoint_tensors(self, config, tensors: Tensors) -> Tensors:
        return super().checkpoint_tensors(config, ((n, t) for n, t in tensors if not n.startswith("vit.")))
