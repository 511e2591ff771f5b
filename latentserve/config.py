"""Shapes and knobs of MLA attention, shared by the layer, builders and backends."""
from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
# `kv_cache_dtype`'s quantized formats (docs/kv_cache_dtypes.md): vLLM's fp8 names, e4m3 at a per-tensor scale of
# 1.0; int8 with a scale per row part (kernels/kv_rows.h), also under llama.cpp's name for its 8-bit cache, q8_0.
FP8_KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
INT8_KV_CACHE_DTYPES = {"int8": torch.int8, "q8_0": torch.int8}
INT8_KV_SCALE_BYTES = 8  # an int8 cache row's trailing fp32 scales: c_kv's, then k_pe's


def kv_cache_row_width(dim: int, dtype: torch.dtype) -> int:
    """Elements a cache row of `dim` values takes in `dtype`: an int8 row carries its scales after its values."""
    return dim + INT8_KV_SCALE_BYTES if dtype == torch.int8 else dim


@dataclass(frozen=True)
class MLAConfig:
    """The dimensions of one MLA layer, named as in the checkpoints' config."""

    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def __post_init__(self) -> None:
        for name in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"MLAConfig.{name} must be a positive int, got {value!r}")
        # 0 rope dims: attention without positions (GLM-5 next's NoPE layers).
        if not isinstance(self.qk_rope_head_dim, int) or self.qk_rope_head_dim < 0:
            raise ValueError(f"MLAConfig.qk_rope_head_dim must be an int >= 0, got {self.qk_rope_head_dim!r}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Values cached per token per layer: the latent plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class LinearAttentionConfig:
    """The dimensions of a hybrid model's linear-attention (KDA) layers; their state is per request, not per token."""

    num_heads: int
    head_dim: int
    conv_kernel_size: int  # the short causal convolution over q, k and v
    # The forget and output gates' projections: low-rank through head_dim (Kimi's f_a/f_b, g_a/g_b) or one each
    # (Ling's f_proj, g_proj).
    gate_lora: bool = True
    # Ling's "safe gate": log decay = lower_bound * sigmoid(exp(A_log) * x) instead of -exp(A_log) * softplus(x).
    gate_lower_bound: float | None = None

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_dim", "conv_kernel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"LinearAttentionConfig.{name} must be a positive int, got {value!r}")

    @property
    def qkv_dim(self) -> int:
        return self.num_heads * self.head_dim


@dataclass(frozen=True)
class AttentionConfig:
    """Per-engine attention settings."""

    block_size: int = 16
    decode_threshold: int = 1
    # Tokens of cached context gathered at once per prefill step (the chunked-context workspace).
    workspace_tokens: int = 8192
    prefill_backend: str | None = None
    decode_backend: str | None = None
    # Debug checks of DBO: per-batch state shared across ubatches, unequal yields per layer; cheap, so on by default.
    debug_ownership: bool = True
    # A token's results independent of the rest of its batch (latentserve.batch_invariant).
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.decode_threshold <= 0:
            raise ValueError(f"decode_threshold must be positive, got {self.decode_threshold}")
        if self.workspace_tokens <= 0:
            raise ValueError(f"workspace_tokens must be positive, got {self.workspace_tokens}")


@dataclass(frozen=True)
class DBOConfig:
    """Dual batch overlap: split a step into two ubatches above a token threshold (vLLM's names and defaults)."""

    enable_dbo: bool = False
    dbo_decode_token_threshold: int = 32  # for batches of decodes only
    dbo_prefill_token_threshold: int = 512  # for batches with any prefill

    def __post_init__(self) -> None:
        for name in ("dbo_decode_token_threshold", "dbo_prefill_token_threshold"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 2:
                raise ValueError(f"{name} must be an int >= 2 (a split needs two tokens), got {value!r}")
