"""dots3 note (dots3_note_text, the language model): two MLA shapes by `layer_types`. "indexed_attention" layers take
the top-level fields under DeepSeek Sparse Attention (an indexer on each, interleaved RoPE); "sliding_attention"
layers take their `per_layer_config` entry (fewer, wider heads, their own LoRA ranks), their own rope theta and a
`sliding_window`, without an indexer. Every layer's MLA scales its normed q and kv latents by sqrt(hidden / rank),
RMS-norms its shared rope key before the rotation and gates each head's output by a sigmoid of the layer's input
(models/dots_attention.py). Shared experts have their own width; routed experts are stored as 3-D tensors."""
from __future__ import annotations

import re
from typing import Any

from latentserve.layers.rotary import RopeConfig
from latentserve.models.arch.deepseek_v32 import DeepseekV32
from latentserve.models.arch.mistral4 import Mistral4
from latentserve.models.arch.base import Tensors
from latentserve.models.fields import Fields

_LAYER_TYPES = ("indexed_attention", "sliding_attention")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class Dots3Note(DeepseekV32):
    model_type = "dots3_note_text"
    architectures = ("Dots3NoteForCausalLM",)
    summary = "dots3 note, text: DSA and sliding-window MLA layers of two shapes, scaled latents, head-gated output"
    defaults = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
                "max_position_embeddings": 524288}
    interleaved_index_rope = True

    def normalize(self, raw: dict[str, Any]) -> dict[str, Any]:
        # rope_parameters per layer type: the top-level rope is the indexed layers', the sliding layers' aside.
        params = raw.get("rope_parameters")
        if not (isinstance(params, dict) and "indexed_attention" in params):
            return raw
        sliding = {"sliding_rope_parameters": _rope_params(raw, "sliding_attention")} if "sliding_attention" in params \
            else {}
        return {**raw, "rope_parameters": _rope_params(raw, "indexed_attention"), **sliding}

    def fields(self, f: Fields, parsed: dict[str, Any]) -> dict[str, Any]:
        num_layers = parsed["num_hidden_layers"]
        types = f.raw.get("layer_types")
        if not isinstance(types, list) or len(types) != num_layers or not set(types) <= set(_LAYER_TYPES):
            raise ValueError(f"{f.where}: field 'layer_types' must list one of {_LAYER_TYPES} for each of the "
                             f"{num_layers} layers, got {types!r}")
        fields = super().fields(f, parsed)
        sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
        return {**fields, "rms_norm_eps": f.float("rms_norm_eps", 1e-5),
                "layer_types": tuple("sliding_attention" if t == "sliding_attention" else "full_attention"
                                     for t in types),
                "sliding_attention": _sliding_attention(f, parsed, sliding[0]) if sliding else None,
                "lora_scales": True, "k_rope_norm": True, "head_output_gate": True,
                "shared_expert_intermediate_size": f.int("shared_experts_intermediate_size", 1536)}

    def indexer_layers(self, f: Fields, num_layers: int) -> tuple[bool, ...]:
        return tuple(t == "indexed_attention" for t in f.raw["layer_types"])

    def checkpoint_tensors(self, config, tensors: Tensors) -> Tensors:
        """The MTP layer (stored as `model.layers.{num_hidden_layers}` and `model.mtp.*`) dropped, as transformers
        drops it; the rope key's norm renamed; the 3-D experts split."""
        renamed = ((name.replace(".self_attn.k_rope_only_layernorm.", ".self_attn.k_rope_norm."), tensor)
                   for name, tensor in tensors if not _is_mtp(name, config.num_hidden_layers))
        return Mistral4().checkpoint_tensors(config, renamed)  # the same 3-D expert tensors


def _is_mtp(name: str, num_layers: int) -> bool:
    layer = _LAYER.match(name)
    return name.startswith("model.mtp.") or (layer is not None and int(layer[1]) >= num_layers)


def _rope_params(raw: dict[str, Any], layer_type: str) -> dict[str, Any]:
    """One layer type's rope parameters, without the partial rotary factor (its rope dims are qk_rope_head_dim)."""
    params = raw["rope_parameters"].get(layer_type)
    if not isinstance(params, dict):
        raise ValueError(f"config.json: field 'rope_parameters' must give {layer_type!r} an object, got {params!r}")
    return {k: v for k, v in params.items() if k != "partial_rotary_factor"}


def _sliding_attention(f: Fields, parsed: dict[str, Any], first: int):
    from latentserve.models.config import LayerAttention  # (config.py imports the adapters)

    per_layer = f.raw.get("per_layer_config") or {}
    entry = per_layer.get(str(first), per_layer.get(first, {}))
    if not isinstance(entry, dict):
        raise ValueError(f"{f.where}: field 'per_layer_config' must give layer {first} an object, got {entry!r}")
    # transformers' per-layer entry lists only what differs from the top-level fields.
    s = Fields({**{k: parsed[k] for k in ("num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                           "qk_rope_head_dim", "v_head_dim")}, **entry},
               where=f"config.json per_layer_config[{first}]")
    nope, rope_dim = s.int("qk_nope_head_dim"), s.int("qk_rope_head_dim")
    if s.int("head_dim", nope + rope_dim) != nope + rope_dim:
        raise ValueError(f"{s.where}: 'head_dim' must equal qk_nope_head_dim + qk_rope_head_dim ({nope + rope_dim})")
    if s.int("num_key_value_heads", s.int("num_attention_heads")) != s.int("num_attention_heads"):
        raise ValueError(f"{s.where}: 'num_key_value_heads' must equal 'num_attention_heads' (MLA)")
    params = Fields(f.raw.get("sliding_rope_parameters") or {"rope_theta": 50000.0},
                    where="config.json rope_parameters['sliding_attention']")
    if params.str("rope_type", "default") != "default":
        raise ValueError(f"{params.where}: 'rope_type' must be 'default', got {params.raw['rope_type']!r}")
    return LayerAttention(
        num_attention_heads=s.int("num_attention_heads"), q_lora_rank=s.int("q_lora_rank"),
        kv_lora_rank=s.int("kv_lora_rank"), qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim,
        v_head_dim=s.int("v_head_dim"), rope=RopeConfig(theta=params.float("rope_theta")),
        sliding_window=f.int("sliding_window", 512))
