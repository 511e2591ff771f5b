"""`SparseMLAAttention`: MLA with DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5)."""
from __future__ import annotations

import torch
from torch import nn

from latentserve.attention.dsa.indexer import Indexer, IndexerInputs
from latentserve.attention.dsa.sparse import sparse_mla_attention
from latentserve.attention.kv_cache import write_kv_cache
from latentserve.attention.mla import MLAAttention
from latentserve.config import AttentionConfig, MLAConfig
from latentserve.forward_context import StaticForwardContext
from latentserve.layers.linear import head_products

INDEXER_CACHE = "indexer"


class SparseMLAAttention(MLAAttention):
    """Each token attends only the `topk` cached positions an indexer selects, in MLA's absorbed form.

    A layer with an `indexer` selects for itself and for the later layers without one (GLM-5's shared layers),
    through the ubatch's `TopKState`. Where every token of the ubatch sees at most `topk` positions the
    selection would keep them all: the layer then runs plain MLA (its prefill and decode backends), unless it has
    attention sinks (`sinks`), which only the sparse path computes.
    """

    def __init__(self, layer_name: str, mla: MLAConfig, scale: float, attn_config: AttentionConfig,
                 static_ctx: StaticForwardContext, index_topk: int, indexer: Indexer | None, sinks: bool = False,
                 kv_cache_dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        super().__init__(layer_name, mla, scale, attn_config, static_ctx, kv_cache_dtype, device)
        if indexer is not None and indexer.config.topk != index_topk:
            raise ValueError(f"{layer_name}: indexer top-k {indexer.config.topk} != layer top-k {index_topk}")
        self.index_topk = index_topk
        self.indexer = indexer
        if indexer is not None:
            self.extra_cache_dims = {INDEXER_CACHE: indexer.cache_dim}
        # Learned per-head sink logits (fp32, as the checkpoints keep them); None: none.
        self.sinks = nn.Parameter(torch.zeros(mla.num_heads, dtype=torch.float32, device=device)) if sinks else None

    def forward(self, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                index_inputs: IndexerInputs | None = None) -> torch.Tensor:
        """`MLAAttention.forward`, the indexer's inputs beside (needed where the layer has an indexer)."""
        md = self.checked_metadata(q)
        dsa = md.dsa
        if dsa is None:
            raise RuntimeError(f"{self.layer_name}: the attention metadata has no DSA part; build it with a builder "
                               "over this model's layers")
        if self.kv_source is None:
            write_kv_cache(self.kv_cache, kv_c_normed, k_pe, md.slot_mapping)
        if self.indexer is not None:
            if index_inputs is None:
                raise ValueError(f"{self.layer_name} runs an indexer: pass its inputs")
            slots = self.indexer(index_inputs, self.extra_caches[INDEXER_CACHE], md.slot_mapping, dsa)
            if slots is not None:
                dsa.state.store(dsa, slots, self.layer_name)
        if dsa.dense:
            if self.sinks is not None:
                raise RuntimeError(f"{self.layer_name} has attention sinks, which only the sparse path computes: its "
                                   "metadata builder must not build dense DSA metadata")
            return self._attend(q, kv_c_normed, k_pe, md)
        slots = dsa.state.load(dsa, self.layer_name)
        m = self.mla
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        q_absorbed = torch.cat([head_products(q_nope, self.W_UK_T, self.kernels, self.head_tokens), q_pe], dim=-1)
        out = sparse_mla_attention(q_absorbed, self.kv_cache, slots, self.scale, m.kv_lora_rank, dsa.workspace,
                                   self.sinks)
        return head_products(out, self.W_UV, self.kernels, self.head_tokens).flatten(1)

    def forward_projected(self, *args, **kwargs) -> None:
        """Never native: the one-call prologue has no place for the indexer between the cache write and attention."""
        return None
