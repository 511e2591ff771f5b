"""`MLADecodeBackend`: absorbed MQA of decode queries straight over the paged latent cache."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from latentserve.attention.backend import BackendCapabilities
from latentserve.attention.metadata import MLADecodeMetadata


class MLADecodeBackend(BackendCapabilities, ABC):
    """Stateless: all per-batch input arrives as arguments, so one instance may serve every ubatch."""

    def __init__(self, num_heads: int, scale: float, kv_lora_rank: int, qk_rope_head_dim: int, config: Any = None,
                 sliding_window: int | None = None):
        if sliding_window is not None and not self.supports_sliding_window:
            raise ValueError(f"{self.get_name()} does not support sliding-window attention")
        self.num_heads = num_heads
        self.scale = scale
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.config = config
        self.sliding_window = sliding_window

    @abstractmethod
    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: MLADecodeMetadata) -> torch.Tensor:
        """q `[T, N, L+R]` (absorbed latent query ‖ rope query) -> `[T, N, L]` in the latent space.

        One KV head: keys are whole cache rows `[c_kv ‖ k_pe]`, values their first L entries. Query token
        j of a request with context c attends cache positions `0..c+j`; with a sliding window W only the last W
        of them, `c+j-W+1..c+j`.
        """
