"""DeepSeek Sparse Attention on the model side: what config.json says of the indexers (`DSAConfig`), and the
attention core each layer gets (attention/dsa/: `SparseMLAAttention`, with its `Indexer` where the layer runs one)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from latentserve.attention.dsa.hidden_query import HiddenQueryIndexer
from latentserve.attention.dsa.indexer import Indexer, IndexerConfig
from latentserve.attention.dsa.kpool import PooledIndexer, kpool_width
from latentserve.attention.dsa.layer import SparseMLAAttention
from latentserve.attention.mla import MLAAttention
from latentserve.config import AttentionConfig
from latentserve.forward_context import StaticForwardContext

if TYPE_CHECKING:
    from latentserve.models.config import ModelConfig


@dataclass(frozen=True)
class DSAConfig:
    index_topk: int
    index_n_heads: int
    index_head_dim: int
    interleaved_rope: bool  # the indexer's RoPE layout: GLM-5's pairs; DeepSeek-V3.2 rotates halves
    # Per layer: runs its own indexer, or (GLM-5's "shared" layers) attends the last such layer's top-k.
    indexer_layers: tuple[bool, ...]
    rope_tail: bool = False  # the indexer rotates its last rope dims (Hunyuan V4)
    k_norm_eps: float = 1e-6
    # A learned logit per head in every softmax's denominator (Hunyuan V4): the layers then always attend through
    # the sparse path, which has a place for it (attention/dsa/sparse.py).
    attention_sinks: bool = False
    # GLM-5 next: the indexers score pools of this many positions (attention/dsa/kpool.py); None: single positions.
    index_kpool: int | None = None
    # Mistral Large 4: the indexers query from the layer's input (attention/dsa/hidden_query.py), not q's LoRA
    hidden_queries: bool = False

    def __post_init__(self) -> None:
        for name in ("index_topk", "index_n_heads", "index_head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"config.json: field {name!r} must be a positive int, got {value!r}")
        if not self.indexer_layers or not self.indexer_layers[0]:
            raise ValueError("config.json: the first layer shares the top-k of an earlier indexer layer, but there "
                             "is none (indexer_types must start with 'full')")
        if self.hidden_queries and self.index_kpool is not None:
            raise ValueError("config.json: indexers that query from the hidden state do not score pools "
                             "(index_kpool)")
        if self.index_kpool is not None:
            kpool_width(self.index_topk, self.index_kpool)  # (checks them)

    @property
    def cache_dim(self) -> int:
        """An indexer layer's cache row per position: its key, and with pools its gate scores."""
        return self.index_head_dim * (1 if self.index_kpool is None else 2)

    @property
    def width(self) -> int:
        """The most positions a token attends: top-k, or with pools top-k plus a tail."""
        return self.index_topk if self.index_kpool is None else kpool_width(self.index_topk, self.index_kpool)

    def runs_indexer(self, layer_idx: int) -> bool:
        """Whether the layer runs its own indexer. MTP layers, stored after the main ones, do (DeepSeek-V3.2's has
        its indexer's weights)."""
        return layer_idx >= len(self.indexer_layers) or self.indexer_layers[layer_idx]

    def num_indexer_layers(self, num_layers: int) -> int:
        """How many of the first `num_layers` layers (main, then MTP) run an indexer: one key cache each."""
        return sum(self.runs_indexer(i) for i in range(num_layers))


def attention_core(config: ModelConfig, name: str, layer_idx: int, attn_config: AttentionConfig,
                   static_ctx: StaticForwardContext, dtype: torch.dtype, device: torch.device | str) -> MLAAttention:
    """The layer's MLA core: plain, or sparse with its indexer where the config has DSA."""
    c, d = config, config.dsa
    if d is None:
        return MLAAttention(name, c.mla_config, c.softmax_scale, attn_config, static_ctx, kv_cache_dtype=dtype,
                            device=device, sliding_window=c.sliding_window)
    indexer = None
    if d.runs_indexer(layer_idx):
        q_input = c.hidden_size if d.hidden_queries else c.q_lora_rank
        ic = IndexerConfig(c.hidden_size, q_input, d.index_n_heads, d.index_head_dim, c.qk_rope_head_dim,
                           d.width, d.interleaved_rope, d.rope_tail, d.k_norm_eps)
        kind = HiddenQueryIndexer if d.hidden_queries else Indexer
        indexer = kind(ic, c.rope) if d.index_kpool is None else PooledIndexer(ic, c.rope, d.index_kpool)
    return SparseMLAAttention(name, c.mla_config, c.softmax_scale, attn_config, static_ctx, d.width, indexer,
                              sinks=d.attention_sinks, kv_cache_dtype=dtype, device=device)
