"""NATIVE: absorbed MQA in one C call per layer (kernels/mla_decode.c), reading the paged cache in place (CPU)."""
from __future__ import annotations

from typing import Any

import torch

from latentserve.attention.backend import NativeKernelsBackend, SelectorConfig
from latentserve.attention.decode.base import MLADecodeBackend
from latentserve.attention.decode.paged import PagedMQADecodeBackend
from latentserve.attention.metadata import MLADecodeMetadata
from latentserve.kernels import native
from latentserve.kernels.policy import default_policy


class NativeMQADecodeBackend(NativeKernelsBackend, MLADecodeBackend):
    """Every decode token and block of heads is one work item: its request's rows are read where they lie, a tile at
    a time, scored and then weighed under an online softmax (fp32 sums; bf16 products through vdpbf16ps where the
    build has them). Several query tokens per request (speculative decoding) see their causal
    prefixes. An fp8 cache is dequantized in registers as its rows are read (kernels/kv_rows.h). PAGED takes a cache in
    another dtype (an fp16 `kv_cache_dtype`). A lone request over a long bf16
    context stays here too: 1.1-3.2x PAGED's oneDNN products from 1k to 16k positions (16 heads x (512 + 64), 2
    threads, benchmarks/RESULTS.md, 2026-12-04 evening)."""

    supported_dtypes = native.KV_CACHE_DTYPES

    @classmethod
    def validate_configuration(cls, device: torch.device | str, selector_config: SelectorConfig) -> list[str]:
        reasons = super().validate_configuration(device, selector_config)
        width = selector_config.kv_lora_rank + selector_config.qk_rope_head_dim
        if width > native.abi.MAX_LATENT:
            reasons.append(f"NATIVE takes cache rows of at most {native.abi.MAX_LATENT} (latent + rope), not {width}")
        return reasons

    def __init__(self, num_heads: int, scale: float, kv_lora_rank: int, qk_rope_head_dim: int, config: Any = None,
                 sliding_window: int | None = None):
        super().__init__(num_heads, scale, kv_lora_rank, qk_rope_head_dim, config, sliding_window)
        self.kernels = default_policy().kernels
        self.paged = PagedMQADecodeBackend(num_heads, scale, kv_lora_rank, qk_rope_head_dim, config)

    def runs_natively(self, kv_cache: torch.Tensor) -> bool:
        """Whether `forward` takes the native kernel for this cache (else PAGED)."""
        return kv_cache.dtype in native.KV_CACHE_DTYPES

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: MLADecodeMetadata) -> torch.Tensor:
        if not self.runs_natively(kv_cache):
            return self.paged.forward(q, kv_cache, metadata)
        return native.mla_decode(self.kernels, q, kv_cache, metadata.block_table, metadata.query_start_loc,
                                 metadata.seq_lens, self.scale, self.kv_lora_rank)
