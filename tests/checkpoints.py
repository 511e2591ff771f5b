"""Tiny random DeepSeek checkpoints written by transformers' `save_pretrained`, and the transformers oracle.

`make_checkpoint(tmp_path, variant)` -> a model directory latentserve can load. Variants:

- ``v2_lite``: V2, q_lora_rank None, greedy softmax routing, first layer dense, YaRN (mscale = mscale_all_dim).
- ``v2_group``: V2, q_lora_rank set, group_limited_greedy routing, all layers MoE, YaRN with
  mscale != mscale_all_dim (so the rope attention factor is not 1), routed_scaling_factor 2.
- ``v3``: V3, q_lora_rank set, sigmoid + correction bias + groups, norm_topk_prob on, first layer dense,
  YaRN, interleaved rope.
- ``v3_nonorm``: V3, q_lora_rank None, norm_topk_prob off, all layers MoE, plain RoPE, rope_interleave off.

All have two shared experts and weights large enough that routing and attention matter.
"""
from __future__ import annotations

from pathlib import Path

import torch

_COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=2,
    max_position_embeddings=256,
    initializer_range=0.15,
    tie_word_embeddings=False,
)

_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, beta_fast=32,
             beta_slow=1)

VARIANTS: dict[str, tuple[str, dict]] = {
    "v2_lite": ("v2", dict(q_lora_rank=None, topk_method="greedy", first_k_dense_replace=1,
                           rope_parameters=dict(_YARN, mscale=0.707, mscale_all_dim=0.707))),
    "v2_group": ("v2", dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                            first_k_dense_replace=0, routed_scaling_factor=2.0,
                            rope_parameters=dict(_YARN, mscale=1.0, mscale_all_dim=0.5))),
    "v3": ("v3", dict(q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True, first_k_dense_replace=1,
                      routed_scaling_factor=2.5, rope_interleave=True,
                      rope_parameters=dict(_YARN, mscale=1.0, mscale_all_dim=1.0))),
    "v3_nonorm": ("v3", dict(q_lora_rank=None, n_group=2, topk_group=1, norm_topk_prob=False,
                             first_k_dense_replace=0, routed_scaling_factor=1.5, rope_interleave=False,
                             rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
}


def make_config(variant: str, **overrides):
    """The transformers config of a variant (DeepseekV2Config or DeepseekV3Config)."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    if variant not in VARIANTS:
        raise ValueError(f"unknown checkpoint variant {variant!r}; choose from {sorted(VARIANTS)}")
    generation, fields = VARIANTS[variant]
    cls = DeepseekV2Config if generation == "v2" else DeepseekV3Config
    return cls(**{**_COMMON, **fields, **overrides})


def make_reference_model(variant: str, seed: int = 0, **overrides):
    """A random transformers DeepseekV2/V3ForCausalLM (fp32, eager attention); norms, biases and the V3
    correction bias are randomized too (transformers initializes them to constants)."""
    from transformers import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM

    config = make_config(variant, **overrides)
    config._attn_implementation = "eager"
    cls = DeepseekV2ForCausalLM if config.model_type == "deepseek_v2" else DeepseekV3ForCausalLM
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("norm.weight"):
                tensor.uniform_(0.5, 1.5, generator=g)
            elif name.endswith("e_score_correction_bias") or name.endswith(".bias"):
                tensor.normal_(0.0, 0.1, generator=g)
    return model


def make_checkpoint(
    tmp_path: Path, variant: str, dtype: torch.dtype = torch.float32, max_shard_size: str | None = None, seed: int = 0,
    **overrides,
) -> Path:
    """Save a random tiny checkpoint of `variant` under tmp_path and return its directory."""
    model = make_reference_model(variant, seed, **overrides).to(dtype)
    path = Path(tmp_path) / f"{variant}-{str(dtype).removeprefix('torch.')}-{seed}"
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    return path


def load_reference(path: Path):
    """transformers' model of a saved checkpoint: the numerical oracle, fp32 with eager attention."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()
