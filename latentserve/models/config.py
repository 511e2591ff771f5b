"""`ModelConfig`: an MLA model's `config.json`, as transformers or the original checkpoints write it, parsed by the
generic fields and then by its architecture's adapter (models/arch/)."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from latentserve.config import LinearAttentionConfig, MLAConfig
from latentserve.layers.hyper_connection import HyperConnectionConfig
from latentserve.layers.logit_softcap import check_softcap
from latentserve.layers.quant.config import Fp8Config, PrequantizedConfig
from latentserve.models.formats import checkpoint_quantization
from latentserve.layers.moe import RoutingConfig
from latentserve.layers.rotary import RopeConfig, mla_softmax_scale
from latentserve.models.arch import architecture_for
from latentserve.models.dsa import DSAConfig
from latentserve.models.fields import Fields


@dataclass(frozen=True)
class LayerAttention:
    """The MLA shape of the layers whose `layer_types` entry is "sliding_attention", where it differs from the model's
    top-level fields (dots3_note: fewer, wider heads, their own LoRA ranks and rope theta, a window)."""

    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope: RopeConfig
    sliding_window: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str  # the adapter's (models/arch/)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None  # None: q_proj straight from hidden (V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    routing: RoutingConfig | None  # None: no routed experts, every layer dense
    moe_intermediate_size: int
    n_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    rope: RopeConfig
    rope_style: str  # see latentserve.layers.rotary
    rms_norm_eps: float
    attention_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    num_nextn_predict_layers: int  # MTP layers stored after the main ones; not run
    max_position_embeddings: int
    # How the checkpoint stores its weights; None: plain fp32/bf16/fp16.
    quantization: Fp8Config | PrequantizedConfig | None = None
    # Each main layer's MLP, "dense" or "sparse", where the config lists them (GLM, A.X); None, and for the MTP
    # layers after them: by first_k_dense_replace and moe_layer_freq.
    mlp_layer_types: tuple[str, ...] | None = None
    moe_output_norm: bool = False  # an RMSNorm on each MoE's output, before the residual (layers/normed_moe.py)
    embedding_scale: float = 1.0  # the embeddings' multiplier (MiniCPM3's scale_emb)
    residual_scale: float = 1.0  # each sublayer's output multiplier before its residual add (MiniCPM3)
    logits_scaling: float = 1.0  # the final hidden states' divisor before the head (transformers' name, MiniCPM3)
    # Mistral 4: queries times 1 + beta * log(1 + floor(position / rope.original_max_position_embeddings))
    llama4_scaling_beta: float | None = None
    # LongCat-Flash: each layer two attention + dense MLP sublayers, and an MoE on the first's normed input whose
    # output joins the second's residual (models/shortcut_layer.py); routed experts past n_routed_experts -
    # zero_expert_num are identities (layers/zero_expert_moe.py)
    shortcut_moe: bool = False
    zero_expert_num: int = 0
    dsa: DSAConfig | None = None  # DeepSeek Sparse Attention's indexers (models/dsa.py); None: dense MLA
    # A.X K2: one projection from q's LoRA gives the query and a sigmoid gate on the attention output
    # (models/gated_attention.py), and the input norms and the MoE layers' norms are gated (layers/gated_norm.py).
    q_output_gate: bool = False
    gated_norm_rank: int | None = None
    hidden_output_gate: bool = False  # Hunyuan V4: a sigmoid gate on the attention output from the layer's input
    # Hunyuan V4: the residual stream is `hc_mult` streams, mixed into each block's input and out of its output by
    # learned hyper-connections (layers/hyper_connection.py); None: one plain residual.
    hyper_connections: HyperConnectionConfig | None = None
    swiglu_limit: float | None = None  # routed experts clamp gate (above) and up (both sides) there; None: no clamp
    swiglu_limit_everywhere: bool = False  # GLM-5 next: the dense layers' MLP and the shared experts clamp as well
    # Each main layer's attention: "full_attention" (MLA), "linear_attention" (hybrid models, docs/hybrids.md:
    # attention/linear/, dimensions in `linear_attention`) or "sliding_attention" (MLA of the `sliding_attention`
    # shape); None: MLA everywhere.
    layer_types: tuple[str, ...] | None = None
    linear_attention: LinearAttentionConfig | None = None
    rope_free: bool = False  # MLA without positions (Kimi-Linear): the rope dims attend as they are
    head_output_gate: bool = False  # Ling: a sigmoid gate per head on the attention output, from the layer's input
    # dots3_note: the "sliding_attention" layers' own MLA shape (`layer_config` gives a layer its config); a layer's
    # window, set only there (None: the layer attends every position).
    sliding_attention: LayerAttention | None = None
    sliding_window: int | None = None
    # dots3_note's attention (models/dots_attention.py): q's and kv's normed LoRA latents times sqrt(hidden / rank),
    # and an RMSNorm on the shared rope key before its rotation.
    lora_scales: bool = False
    k_rope_norm: bool = False
    shared_expert_intermediate_size: int | None = None  # each shared expert's width; None: moe_intermediate_size
    # Mistral Large 4: rope frequencies times exp of a learned `alpha` each (layers/rotary.py), and each layer's
    # queries times a learned per-head scale * log(position + 1) + bias (layers/query_scaling.py)
    learned_rope_freq_scale: bool = False
    log_position_query_scaling: bool = False
    # Mistral Large 4: per main layer, whether it has rope dims; a NoPE layer's (False) queries and keys are all
    # nope dims, qk_nope_head_dim + qk_rope_head_dim wide (`layer_config`); None: every layer has them
    rope_layers: tuple[bool, ...] | None = None
    # Mistral Large 4: per main layer, the layer whose latent cache it attends (itself: its own); a layer reading an
    # earlier one's has no kv_a projection and writes nothing (attention/mla.py `kv_source`); None: each its own
    kv_sources: tuple[int, ...] | None = None
    # Mistral Large 4: logits become cap * tanh(logits / cap) (layers/logit_softcap.py); None: not capped
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        check_softcap(self.final_logit_softcapping)

    @property
    def num_attention_layers(self) -> int:
        """MLA layers (each its own KV cache) of the main model: not a hybrid's linear-attention layers, which keep a
        state per request; LongCat-Flash's two per layer."""
        mla = sum(not self.is_linear_attention_layer(i) for i in range(self.num_hidden_layers))
        return mla * (2 if self.shortcut_moe else 1)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return mla_softmax_scale(self.qk_head_dim, self.rope)

    @property
    def mla_config(self) -> MLAConfig:
        return MLAConfig(
            self.num_attention_heads, self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        )

    def layer_config(self, layer_idx: int) -> "ModelConfig":
        """The config layer `layer_idx`'s attention is built from: the model's, or for a sliding layer its own MLA
        shape, rope and window, without DSA (its indexers run on the other layers); a NoPE layer's (Mistral Large 4)
        without rope dims, its nope dims that many wider (the softmax scale, of the whole head, stays)."""
        c = self
        s = self.sliding_attention
        if s is not None and self.layer_types is not None and layer_idx < len(self.layer_types) \
                and self.layer_types[layer_idx] == "sliding_attention":
            c = replace(c, num_attention_heads=s.num_attention_heads, q_lora_rank=s.q_lora_rank,
                        kv_lora_rank=s.kv_lora_rank, qk_nope_head_dim=s.qk_nope_head_dim,
                        qk_rope_head_dim=s.qk_rope_head_dim, v_head_dim=s.v_head_dim, rope=s.rope,
                        sliding_window=s.sliding_window, dsa=None)
        if self.rope_layers is not None and layer_idx < len(self.rope_layers) and not self.rope_layers[layer_idx]:
            c = replace(c, qk_nope_head_dim=c.qk_head_dim, qk_rope_head_dim=0)
        return c

    def kv_cache_values(self, num_layers: int) -> int:
        """Cache values per token of the first `num_layers` MLA layers (main, then MTP), each at its own width."""
        return sum(self.layer_config(i).mla_config.kv_cache_dim for i in range(num_layers) if self.owns_kv(i))

    def kv_source(self, layer_idx: int) -> int:
        """The layer whose latent cache layer `layer_idx` attends: itself, or an earlier one it reads."""
        return layer_idx if self.kv_sources is None or layer_idx >= len(self.kv_sources) \
            else self.kv_sources[layer_idx]

    def owns_kv(self, layer_idx: int) -> bool:
        return self.kv_source(layer_idx) == layer_idx

    def is_linear_attention_layer(self, layer_idx: int) -> bool:
        return self.layer_types is not None and self.layer_types[layer_idx] == "linear_attention"

    def is_moe_layer(self, layer_idx: int) -> bool:
        if self.routing is None:
            return False
        if self.mlp_layer_types is not None and layer_idx < len(self.mlp_layer_types):
            return self.mlp_layer_types[layer_idx] == "sparse"
        return layer_idx >= self.first_k_dense_replace and layer_idx % self.moe_layer_freq == 0

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "ModelConfig":
        """Parse `model_dir/config.json`."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {model_dir}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        if not isinstance(raw, dict):
            raise ValueError(f"config.json must hold a JSON object, got {type(raw).__name__}")
        architecture, adapter = architecture_for(Fields(raw))
        f = Fields(adapter.normalize(raw))
        if f.str("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: field 'hidden_act' must be 'silu', got {f.raw['hidden_act']!r}")
        defaults = adapter.defaults
        max_positions = f.int("max_position_embeddings", defaults["max_position_embeddings"])
        rope_dim = f.int("qk_rope_head_dim", minimum=0)  # 0: no positions (GLM-5 next)
        if rope_dim % 2:
            raise ValueError(f"config.json: field 'qk_rope_head_dim' must be even, got {rope_dim}")
        routing = _routing(f, defaults)
        moe = routing is not None
        parsed = dict(
            architecture=architecture,
            model_type=adapter.model_type,
            vocab_size=f.int("vocab_size"),
            hidden_size=f.int("hidden_size"),
            intermediate_size=f.int("intermediate_size"),
            num_hidden_layers=f.int("num_hidden_layers"),
            num_attention_heads=f.int("num_attention_heads"),
            q_lora_rank=f.int("q_lora_rank", None),
            kv_lora_rank=f.int("kv_lora_rank"),
            qk_nope_head_dim=f.int("qk_nope_head_dim"),
            qk_rope_head_dim=rope_dim,
            v_head_dim=f.int("v_head_dim"),
            routing=routing,
            moe_intermediate_size=f.int("moe_intermediate_size") if moe else 0,
            n_shared_experts=f.int("n_shared_experts", 0, minimum=0) if moe else 0,
            first_k_dense_replace=f.int("first_k_dense_replace", 0, minimum=0),
            moe_layer_freq=f.int("moe_layer_freq", 1),
            rope=_rope(f, max_positions, rope_dim),
            rms_norm_eps=f.float("rms_norm_eps", 1e-6),
            attention_bias=f.bool("attention_bias", False),
            tie_word_embeddings=f.bool("tie_word_embeddings", False),
            num_nextn_predict_layers=f.int("num_nextn_predict_layers", 0, minimum=0),
            max_position_embeddings=max_positions,
            quantization=(checkpoint_quantization(raw["quantization_config"]) if raw.get("quantization_config")
                          else None),
        )
        return cls(**{**parsed, **adapter.fields(f, parsed)})


def _routing(f: Fields, defaults: dict[str, Any]) -> RoutingConfig | None:
    num_experts = f.int("n_routed_experts", None)
    if num_experts is None:
        return None
    return RoutingConfig(
        n_routed_experts=num_experts,
        num_experts_per_tok=f.int("num_experts_per_tok"),
        scoring_func=f.str("scoring_func", defaults["scoring_func"]),
        topk_method=f.str("topk_method", defaults["topk_method"]),
        n_group=f.int("n_group", None),
        topk_group=f.int("topk_group", None),
        norm_topk_prob=f.bool("norm_topk_prob", defaults["norm_topk_prob"]),
        routed_scaling_factor=f.float("routed_scaling_factor", 1.0),
    )


def _rope(f: Fields, max_positions: int, rope_dim: int) -> RopeConfig:
    # transformers writes `rope_parameters` (theta inside); DeepSeek's own configs `rope_scaling` + `rope_theta`.
    name = "rope_parameters" if f.raw.get("rope_parameters") is not None else "rope_scaling"
    params = f.raw.get(name) or {}
    if not isinstance(params, dict):
        raise ValueError(f"config.json: field {name!r} must be an object, got {params!r}")
    p = Fields(params, where=f"config.json {name}")
    theta = p.float("rope_theta", f.float("rope_theta", 10000.0))
    if p.float("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"config.json {name}: 'partial_rotary_factor' other than 1.0 is not supported")
    rope_type = p.str("rope_type", p.str("type", "default"))
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type not in ("yarn", "longrope"):
        raise ValueError(f"config.json {name}: 'rope_type' must be 'default', 'yarn' or 'longrope', got {rope_type!r}")
    # A top-level original_max_position_embeddings wins over the nested one, as in transformers.
    original = f.int("original_max_position_embeddings", None)
    original = original or p.int("original_max_position_embeddings", max_positions)
    if rope_type == "longrope":
        return RopeConfig(
            theta=theta, rope_type="longrope", factor=p.float("factor", max_positions / original),
            original_max_position_embeddings=original, attention_factor=p.float("attention_factor", None),
            short_factor=_rope_factors(p, "short_factor", rope_dim),
            long_factor=_rope_factors(p, "long_factor", rope_dim))
    return RopeConfig(
        theta=theta,
        rope_type="yarn",
        factor=p.float("factor", max_positions / original),
        original_max_position_embeddings=original,
        # transformers treats 0 like unset here.
        beta_fast=p.float("beta_fast", None, positive=False) or 32.0,
        beta_slow=p.float("beta_slow", None, positive=False) or 1.0,
        mscale=p.float("mscale", None, positive=False),
        mscale_all_dim=p.float("mscale_all_dim", None, positive=False),
        attention_factor=p.float("attention_factor", None),
        truncate=p.bool("truncate", True),
    )


def _rope_factors(p: Fields, name: str, rope_dim: int) -> tuple[float, ...]:
    """LongRoPE's per-frequency divisors: one positive number per pair of rope dims."""
    value = p.raw.get(name)
    if (not isinstance(value, list) or len(value) != rope_dim // 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in value)):
        raise ValueError(f"{p.where}: field {name!r} must list {rope_dim // 2} positive numbers (one per pair of "
                         f"the {rope_dim} rope dims), got {value!r}")
    return tuple(float(v) for v in value)
