"""The k-pool indexer (GLM-5 next): DSA's lightning indexer scoring pools of `kpool` consecutive positions instead
of single ones, then attending every position of the chosen pools.

Positions are grouped from 0 in complete pools of `kpool`. A pool's key is a learned weighted average of its
positions' indexer keys: per channel, softmax over the pool of `gate(x) + ape[i]` (`index_kpool_compress_gate`
`[D, hidden]` applied to each position's layer input, `index_kpool_compress_ape` `[kpool, D]` by place in the pool).
A token scores the pools that end at or before it as the plain indexer scores positions, keeps the best
`topk / kpool` of them and attends all their positions, plus its own incomplete pool (the tail: the positions after
its last complete pool up to itself). So a token selects at most `topk + kpool - 1` positions, the layer's width:
a token that sees no more than that many keeps them all, which is where the layer attends densely.

Each position's cache row holds its key and its gate scores (`2 * D`). No RoPE: the model has none (NoPE).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from latentserve.attention.dsa.indexer import _SCORE_ELEMENTS, Indexer, IndexerConfig, IndexerInputs
from latentserve.attention.dsa.metadata import DSAMetadata
from latentserve.attention.kv_cache import write_cache_rows
from latentserve.layers.rotary import RopeConfig


def kpool_width(index_topk: int, kpool: int) -> int:
    """The most positions one token selects: `topk / kpool` pools and its tail."""
    if kpool < 1 or index_topk % kpool:
        raise ValueError(f"config.json: field 'index_topk' ({index_topk}) must be a multiple of 'index_kpool' "
                         f"({kpool}), a positive int")
    return index_topk + kpool - 1


class PooledIndexer(Indexer):
    """`Indexer` over pools; `config.topk` is the layer's width (`kpool_width`)."""

    def __init__(self, config: IndexerConfig, rope: RopeConfig, kpool: int) -> None:
        if config.rope_dim:
            raise ValueError(f"the k-pool indexer has no RoPE, got {config.rope_dim} rope dims")
        super().__init__(config, rope)
        self.kpool = kpool
        self.num_pools = (config.topk - kpool + 1) // kpool  # selected per token
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(kpool, config.head_dim))
        self.index_kpool_compress_gate = nn.Parameter(torch.zeros(config.head_dim, config.hidden_size))

    @property
    def cache_dim(self) -> int:
        return 2 * self.config.head_dim

    def forward(self, x: IndexerInputs, cache: torch.Tensor, slot_mapping: torch.Tensor,
                md: DSAMetadata) -> torch.Tensor | None:
        c = self.config
        k = self.k_norm(self.wk(x.hidden))
        gates = F.linear(x.hidden, self.index_kpool_compress_gate)
        write_cache_rows(cache, torch.cat([k, gates], dim=-1), slot_mapping)
        if md.dense:
            return None
        q = self.wq_b(x.q_resid).view(-1, c.n_heads, c.head_dim).float()
        weights = self.weights_proj(x.hidden.float()) * c.n_heads**-0.5
        flat = cache.view(-1, self.cache_dim)
        out = torch.full((q.shape[0], md.topk), -1, dtype=torch.long, device=q.device)
        qsl = md.query_start_loc_cpu
        for r, slots in enumerate(md.req_slots):
            pool_keys = self._pool_keys(flat.index_select(0, slots))
            first = md.context_lens_cpu[r]
            positions = torch.arange(first, first + qsl[r + 1] - qsl[r], device=q.device)
            step = max(1, _SCORE_ELEMENTS // (c.n_heads * max(1, pool_keys.shape[0])))
            for s in range(qsl[r], qsl[r + 1], step):
                e = min(s + step, qsl[r + 1])
                out[s:e] = self._select_pools(q[s:e], weights[s:e], pool_keys, slots,
                                              positions[s - qsl[r]: e - qsl[r]], md.topk)
        return out

    def _pool_keys(self, rows: torch.Tensor) -> torch.Tensor:
        """Cache rows `[S, 2D]` of positions 0.. -> the complete pools' keys `[S // kpool, D]` (fp32)."""
        d, p = self.config.head_dim, self.kpool
        rows = rows[: rows.shape[0] // p * p].view(-1, p, 2 * d)
        keys, gates = rows.split(d, dim=-1)
        probs = (gates.float() + self.index_kpool_compress_ape.float()).softmax(dim=1)
        return (probs * keys.float()).sum(dim=1)

    def _select_pools(self, q: torch.Tensor, weights: torch.Tensor, pool_keys: torch.Tensor, slots: torch.Tensor,
                      positions: torch.Tensor, width: int) -> torch.Tensor:
        """q `[n, H, D]`, weights `[n, H]` -> the slots `[n, width]` (-1: none) of each token's chosen pools and
        tail."""
        p, device = self.kpool, q.device
        offsets = torch.arange(p, device=device)
        # The tail: the positions of the token's own incomplete pool, up to itself.
        tail_start = positions + 1 - (positions + 1) % p
        tail = tail_start[:, None] + offsets[:-1]
        tail = torch.where(tail <= positions[:, None], tail, -1)
        if pool_keys.shape[0] == 0:
            chosen = torch.empty(q.shape[0], 0, dtype=torch.long, device=device)
        else:
            scores = torch.einsum("nhd,sd->nhs", q, pool_keys).mul_(self.config.head_dim**-0.5).relu_()
            index = torch.bmm(weights[:, None, :], scores)[:, 0]
            pool_end = torch.arange(pool_keys.shape[0], device=device) * p + p - 1
            index.masked_fill_(pool_end[None, :] > positions[:, None], float("-inf"))
            values, pools = index.topk(min(self.num_pools, pool_keys.shape[0]), dim=-1)
            none = (values == float("-inf"))[..., None]  # fewer visible pools than asked for
            chosen = (pools[..., None] * p + offsets).masked_fill_(none, -1).flatten(1)
        selected = torch.cat([chosen, tail], dim=-1)
        selected = torch.where(selected >= 0, slots[selected.clamp(min=0)], -1)
        return F.pad(selected, (0, width - selected.shape[1]), value=-1)
