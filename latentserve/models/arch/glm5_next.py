"""GLM-5 next (glm5_next), its language model on text (the config's `text_config`; the vision tower's tensors,
`model.visual.*`, are not loaded). A hybrid (docs/hybrids.md): Kimi Delta Attention layers with Ling's lower-bounded
forget gate, and every fourth layer MLA without positions (`qk_rope_head_dim` 0) under DeepSeek Sparse Attention
whose indexer scores pools of `index_kpool` positions (attention/dsa/kpool.py). Over them:

- mHC residual streams (`hc_mult`), mixed by Sinkhorn-normalized matrices (layers/mhc.py), their mean at the end;
- SwiGLU clamped at `swiglu_limit` before the activation (gate above, up both sides) in every MLP: routed and
  shared experts and the dense layers.
"""
from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from latentserve.config import LinearAttentionConfig
from latentserve.layers.hyper_connection import HyperConnectionConfig
from latentserve.models.arch.base import Tensors, mlp_layer_types
from latentserve.models.arch.deepseek_v32 import GlmMoeDsa
from latentserve.models.arch.kimi_linear import checked_layer_types
from latentserve.models.fields import Fields

_HC = re.compile(r"\.hc_(attn|ffn)_(fn|base|scale)$")


class Glm5Next(GlmMoeDsa):
    model_type = "glm5_next"
    architectures = ("Glm5NextForConditionalGeneration",)
    summary = ("GLM-5 next, text only: KDA and NoPE sparse-MLA layers (pooled indexer), mHC streams, clamped "
               "SwiGLU")
    defaults = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
                "max_position_embeddings": 1048576}

    def normalize(self, raw: dict[str, Any]) -> dict[str, Any]:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"config.json: field 'text_config' must be an object, got {text!r}")
        outer = {k: raw[k] for k in ("architectures", "tie_word_embeddings", "quantization_config") if k in raw}
        text = {**text, **outer, "model_type": self.model_type}
        # One expert group by default (transformers' config): top-k over all experts.
        return {**text, "n_group": text.get("n_group") or 1, "topk_group": text.get("topk_group") or 1}

    def fields(self, f: Fields, parsed: dict[str, Any]) -> dict[str, Any]:
        num_layers = parsed["num_hidden_layers"]
        if parsed["qk_rope_head_dim"] != 0:
            raise ValueError(f"{f.where}: field 'qk_rope_head_dim' must be 0 (GLM-5 next's attention has no "
                             f"positions), got {parsed['qk_rope_head_dim']}")
        if not f.bool("index_kpool_always_select_tail", True):
            raise ValueError(f"{f.where}: field 'index_kpool_always_select_tail' false is not supported (tokens "
                             "would not attend their own incomplete pool)")
        fields = super().fields(f, parsed)
        fields["dsa"] = replace(fields["dsa"], index_kpool=f.int("index_kpool", 16))
        limit = f.float("swiglu_limit", 10.0, positive=False)
        eps = parsed["rms_norm_eps"]
        hc = HyperConnectionConfig(f.int("hc_mult", 4), 2.0, f.float("hc_eps", 1e-6), eps,
                                   f.int("hc_sinkhorn_iters", 20, minimum=1))
        return {**fields, "rope_style": "neox", "rope_free": True, "hyper_connections": hc,
                "swiglu_limit": limit if limit > 0 else None, "swiglu_limit_everywhere": True,
                "mlp_layer_types": mlp_layer_types(f, num_layers, first_dense=3),
                "layer_types": _layer_types(f, num_layers),
                "linear_attention": LinearAttentionConfig(
                    num_heads=f.int("linear_num_heads", 64), head_dim=f.int("linear_head_dim", 128),
                    conv_kernel_size=f.int("linear_conv_kernel_dim", 4),
                    gate_lower_bound=None if f.raw.get("linear_lower_bound", -5.0) is None
                    else f.float("linear_lower_bound", -5.0, positive=False)),
                "num_nextn_predict_layers": 0}

    def checkpoint_tensors(self, config, tensors: Tensors) -> Tensors:
        heads = config.linear_attention.num_heads
        for name, tensor in tensors:
            if name.startswith("model.visual."):
                continue  # the vision tower: text only
            name = name.replace("model.language_model.", "model.", 1)
            name = _HC.sub(r".\1_hc.\2", name)
            if name.endswith(".self_attn.A_log"):
                tensor = tensor.reshape(1, 1, heads, 1)  # stored per head; the layer keeps Kimi's layout
            yield name, tensor


def _layer_types(f: Fields, num_layers: int) -> tuple[str, ...]:
    """`layer_types` ("linear_attention" / "indexed_attention"), by default MLA at every fourth layer from the
    fourth."""
    types = f.raw.get("layer_types")
    if types is None:
        types = ["linear_attention" if i % 4 != 3 else "full_attention" for i in range(num_layers)]
    if isinstance(types, list):
        types = ["full_attention" if t in ("indexed_attention", "full_attention") else t for t in types]
    return checked_layer_types(types, num_layers)
