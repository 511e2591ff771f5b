"""The lightning indexer of DeepSeek Sparse Attention: which `topk` cached positions each token attends.

Per token t and cached position s: `score[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s] / sqrt(D))`, with
`q = wq_b(q_resid)` (H heads of D), one key head `k = LayerNorm(wk(x))` cached per layer in its own paged cache,
RoPE on the first `rope_dim` dims of both (half-split in DeepSeek-V3.2, interleaved pairs in GLM-5; Hunyuan V4 rotates
the last `rope_dim` in pairs), and per-head
weights `w = weights_proj(x) / sqrt(H)` kept in fp32. Scores are computed in fp32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from latentserve.attention.dsa.metadata import DSAMetadata
from latentserve.attention.kv_cache import write_cache_rows
from latentserve.layers.linear import Linear
from latentserve.layers.rotary import RopeConfig, RotaryEmbedding

# Score-matrix elements (tokens x heads x positions) computed at once, bounding a long prefill's memory.
_SCORE_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class IndexerConfig:
    hidden_size: int
    q_lora_rank: int
    n_heads: int
    head_dim: int
    rope_dim: int
    topk: int
    interleaved_rope: bool  # GLM-5's pairs; DeepSeek-V3.2 rotates halves
    rope_tail: bool = False  # RoPE on the last rope_dim dims (Hunyuan V4), not the first
    k_norm_eps: float = 1e-6


@dataclass
class IndexerInputs:
    """What the indexer reads of a layer beside the cache: its normed input, q's LoRA residual, the rope angles."""

    hidden: torch.Tensor  # [T, hidden_size]
    q_resid: torch.Tensor  # [T, q_lora_rank]
    cos: torch.Tensor  # [T, rope_dim], from the model's `RotaryEmbedding.cos_sin` (halves layout)
    sin: torch.Tensor


class Indexer(nn.Module):
    """Writes each new token's key into the layer's indexer cache and selects every token's top-k positions."""

    def __init__(self, config: IndexerConfig, rope: RopeConfig) -> None:
        super().__init__()
        c = config
        if c.rope_dim > c.head_dim:
            raise ValueError(f"indexer rope dims ({c.rope_dim}) exceed its head_dim ({c.head_dim})")
        self.config = c
        self.wq_b = Linear(c.q_lora_rank, c.n_heads * c.head_dim, bias=False)
        self.wk = Linear(c.hidden_size, c.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(c.head_dim, eps=c.k_norm_eps)
        # fp32 whatever the model dtype, as the checkpoints keep it (its weights decide the ranking).
        self.weights_proj = Linear(c.hidden_size, c.n_heads, bias=False, dtype=torch.float32)
        # Only its rotate() is used, on the model's cos/sin: the indexer's layout, the model's angles.
        # None: no RoPE (GLM-5 next's NoPE layers).
        self.rotary = RotaryEmbedding(c.rope_dim, rope, "interleave" if c.interleaved_rope else "neox") if c.rope_dim \
            else None

    @property
    def cache_dim(self) -> int:
        """Its cache row per position: the key."""
        return self.config.head_dim

    def forward(self, x: IndexerInputs, cache: torch.Tensor, slot_mapping: torch.Tensor,
                md: DSAMetadata) -> torch.Tensor | None:
        """Cache the new keys; the selected cache slots `[T, topk]` (-1: none), or None when `md.dense`."""
        c = self.config
        k = self._rope(self.k_norm(self.wk(x.hidden)), x.cos, x.sin)
        write_cache_rows(cache, k, slot_mapping)
        if md.dense:
            return None
        q = self._rope(self.queries(x, md), x.cos[:, None], x.sin[:, None])
        weights = self.weights_proj(x.hidden.float()) * c.n_heads**-0.5
        flat = cache.view(-1, c.head_dim)
        out = torch.full((q.shape[0], md.topk), -1, dtype=torch.long, device=q.device)
        qsl = md.query_start_loc_cpu
        for r, slots in enumerate(md.req_slots):
            keys = flat.index_select(0, slots).float()
            positions = torch.arange(md.context_lens_cpu[r], md.context_lens_cpu[r] + qsl[r + 1] - qsl[r],
                                     device=q.device)
            step = max(1, _SCORE_ELEMENTS // (c.n_heads * keys.shape[0]))
            for s in range(qsl[r], qsl[r + 1], step):
                e = min(s + step, qsl[r + 1])
                out[s:e] = self._select(q[s:e].float(), weights[s:e], keys, slots, positions[s - qsl[r]: e - qsl[r]],
                                        md.topk)
        return out

    def queries(self, x: IndexerInputs, md: DSAMetadata) -> torch.Tensor:
        """The indexer's queries `[T, H, D]` before RoPE: from q's LoRA residual."""
        return self.wq_b(x.q_resid).view(-1, self.config.n_heads, self.config.head_dim)

    def _rope(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c = self.config
        if self.rotary is None:
            return t
        if c.rope_tail:
            rest, rot = t.split([c.head_dim - c.rope_dim, c.rope_dim], dim=-1)
            return torch.cat([rest, self.rotary.rotate(rot, cos, sin)], dim=-1)
        rot, rest = t.split([c.rope_dim, c.head_dim - c.rope_dim], dim=-1)
        return torch.cat([self.rotary.rotate(rot, cos, sin), rest], dim=-1)

    def _select(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor,
                positions: torch.Tensor, topk: int) -> torch.Tensor:
        """q `[n, H, D]`, weights `[n, H]`, keys `[S, D]` -> the slots of each token's top-k causal positions."""
        scores = torch.einsum("nhd,sd->nhs", q, keys).mul_(self.config.head_dim**-0.5).relu_()
        index = torch.bmm(weights[:, None, :], scores)[:, 0]
        future = torch.arange(keys.shape[0], device=q.device)[None, :] > positions[:, None]
        index.masked_fill_(future, float("-inf"))
        k = min(topk, keys.shape[0])
        values, idx = index.topk(k, dim=-1)
        selected = torch.where(values == float("-inf"), -1, slots[idx])
        return F.pad(selected, (0, topk - k), value=-1)
