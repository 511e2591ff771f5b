"""Mistral Large 3/4 (mistral_large4), its language model on text (the config's `text_config`; the vision tower,
its projector and patch merger are not loaded). DeepSeek-V3's MLA without q LoRA and Mistral 4's routing, under
DeepSeek Sparse Attention whose indexers query from the layer's input (attention/dsa/hidden_query.py), plus:

- a learned scale per rope frequency (`lerope.alpha`: each frequency times exp(alpha));
- per layer and head, queries (the attention's and the indexer's) times a learned scale * log(position + 1) + bias;
- logits soft-capped at `final_logit_softcapping`;
- Mistral's native tensor names (`layers.{i}.attention.wq`, `tok_embeddings`, `output`, ...), as the checkpoints and
  transformers' `save_pretrained` write them;
- NoPE layers (`no_rope_layers` 0): their heads all nope dims (`ModelConfig.layer_config`), their indexers without
  RoPE;
- layers that read an earlier layer's latent cache (`kv_source_layers`): no kv_a projection of their own, the
  source's cache rows (attention/mla.py `kv_source`); the KV memory budget counts only the sources.
"""
from __future__ import annotations

import re
from typing import Any

from latentserve.models.arch.base import Tensors, mlp_layer_types
from latentserve.models.arch.deepseek_v32 import GlmMoeDsa
from latentserve.models.fields import Fields

# Mistral's native names -> the core's, applied in order to each tensor's name.
_RENAMES = [(re.compile(p), r) for p, r in (
    (r"^tok_embeddings\.", "model.embed_tokens."),
    (r"^norm\.", "model.norm."),
    (r"^output\.", "lm_head."),
    (r"^layers\.", "model.layers."),
    (r"\.attention_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.attention\.", ".self_attn."),
    (r"\.wq\.", ".q_proj."),
    (r"\.wkv_a_with_mqa\.", ".kv_a_proj_with_mqa."),
    (r"\.kv_a_norm\.", ".kv_a_layernorm."),
    (r"\.wkv_b\.", ".kv_b_proj."),
    (r"\.wo\.", ".o_proj."),
    (r"\.ssmax_scaling\.s$", ".softmax_scaling.scale"),
    (r"\.ssmax_scaling\.b$", ".softmax_scaling.bias"),
    (r"\.feed_forward\.", ".mlp."),
    (r"\.gate\.weight$", ".mlp.gate.weight"),
    (r"\.(experts\.\d+|shared_experts)\.", r".mlp.\1."),
    (r"\.w1\.", ".gate_proj."),
    (r"\.w2\.", ".down_proj."),
    (r"\.w3\.", ".up_proj."),
)]
_TEXT_ONLY = re.compile(r"^(vision_encoder|patch_merger|pre_mm_projector_norm|vision_language_adapter)\.")


class MistralLarge4(GlmMoeDsa):
    model_type = "mistral_large4"
    architectures = ("MistralLarge4ForConditionalGeneration",)
    summary = ("Mistral Large 3/4, text only: DSA with hidden-state indexer queries, learned rope frequency and "
               "log-position query scales, logit soft-cap, Mistral-native tensor names")
    hidden_index_queries = True
    defaults = {"scoring_func": "softmax", "topk_method": "group_limited_top2", "norm_topk_prob": True,
                "max_position_embeddings": 1048576}

    def normalize(self, raw: dict[str, Any]) -> dict[str, Any]:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"config.json: field 'text_config' must be an object, got {text!r}")
        outer = {k: raw[k] for k in ("architectures", "tie_word_embeddings", "quantization_config") if k in raw}
        # transformers' router always renormalizes its top-k weights; no q LoRA
        return {**text, **outer, "model_type": self.model_type, "norm_topk_prob": True, "q_lora_rank": None}

    def fields(self, f: Fields, parsed: dict[str, Any]) -> dict[str, Any]:
        num_layers = parsed["num_hidden_layers"]
        rope_layers = _rope_layers(f, num_layers)
        fields = super().fields(f, parsed)
        cap = f.raw.get("final_logit_softcapping", 30.0)
        return {**fields,
                "mlp_layer_types": mlp_layer_types(f, num_layers, first_dense=f.int("first_k_dense_replace", 1,
                                                                                    minimum=0)),
                "rms_norm_eps": f.float("rms_norm_eps", 1e-5), "learned_rope_freq_scale": True,
                "log_position_query_scaling": True, "final_logit_softcapping": cap, "num_nextn_predict_layers": 0,
                "rope_layers": rope_layers, "kv_sources": _kv_sources(f, rope_layers)}

    def checkpoint_tensors(self, config, tensors: Tensors) -> Tensors:
        for name, tensor in tensors:
            if _TEXT_ONLY.match(name):
                continue
            if name == "lerope.alpha":
                # the model's rotary embeddings are one per distinct rope, in layer order: a first NoPE layer's
                # (no dims, no alpha) comes first
                name = f"model.rotary_embs.{0 if config.layer_config(0).qk_rope_head_dim else 1}.alpha"
            for pattern, repl in _RENAMES:
                name = pattern.sub(repl, name)
            yield name, tensor


def _rope_layers(f: Fields, num_layers: int) -> tuple[bool, ...]:
    """`no_rope_layers` (1: the layer has rope dims, 0: NoPE), by default transformers' NoPE at every fourth layer."""
    flags = f.raw.get("no_rope_layers")
    if flags is None:
        flags = [int((i + 1) % 4 != 0) for i in range(num_layers)]
    if (not isinstance(flags, list) or len(flags) < num_layers
            or any(isinstance(x, bool) or x not in (0, 1) for x in flags)):
        raise ValueError(f"{f.where}: field 'no_rope_layers' must give 1 (rope) or 0 (NoPE) for each of the "
                         f"{num_layers} layers, got {flags!r}")
    return tuple(bool(x) for x in flags[:num_layers])


def _kv_sources(f: Fields, rope_layers: tuple[bool, ...]) -> tuple[int, ...]:
    """`kv_source_layers`: per layer, the layer whose latent cache it attends (itself: its own). transformers hands a
    reading layer the latest cache-sharing layer's of its own kind (rope or NoPE), so a source must be that one."""
    n = len(rope_layers)
    sources = f.raw.get("kv_source_layers")
    if sources is None:
        return tuple(range(n))
    if not isinstance(sources, list) or len(sources) != n or any(
            isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= i or sources[s] != s
            for i, s in enumerate(sources)):
        raise ValueError(f"{f.where}: field 'kv_source_layers' must give each of the {n} layers itself or an earlier "
                         f"layer that is its own source, got {sources!r}")
    owners = {s for i, s in enumerate(sources) if s != i}
    for i, s in enumerate(sources):
        if s == i:
            continue
        later = [p for p in owners if s < p < i and rope_layers[p] == rope_layers[i]]
        if rope_layers[s] != rope_layers[i] or later:
            raise ValueError(f"{f.where}: field 'kv_source_layers' makes layer {i} read layer {s}'s cache, but "
                             f"{'its rope kind differs' if rope_layers[s] != rope_layers[i] else f'layer {later[0]}'} "
                             "(a layer reads the latest shared cache of its own rope kind)")
    return tuple(sources)
