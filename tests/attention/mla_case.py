"""Random MLA batches over a paged cache, and a naive fp32 reference to check them against."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from latentserve.attention.builder import MLAMetadataBuilder
from latentserve.attention.kv_cache import allocate_kv_caches
from latentserve.attention.metadata import CommonAttentionMetadata
from latentserve.attention.mla import MLAAttention
from latentserve.config import AttentionConfig, MLAConfig
from latentserve.forward_context import ForwardContext, StaticForwardContext, set_forward_context

MLA = MLAConfig(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
SCALE = MLA.qk_head_dim**-0.5


@dataclass
class Request:
    context_len: int
    query_len: int

    @property
    def seq_len(self) -> int:
        return self.context_len + self.query_len


@dataclass
class Batch:
    """Per-request full latents (`c`, `k_pe`: all seq positions) and new-token queries."""

    requests: list[Request]
    c: list[torch.Tensor]
    k_pe: list[torch.Tensor]
    q: list[torch.Tensor]
    common: CommonAttentionMetadata

    def new_token_inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = torch.cat(self.q)
        c = torch.cat([c[r.context_len :] for c, r in zip(self.c, self.requests)])
        k_pe = torch.cat([k[r.context_len :] for k, r in zip(self.k_pe, self.requests)])
        return q, c, k_pe


def make_layer(
    attn_config: AttentionConfig, kv_cache_dtype: torch.dtype = torch.float32, name: str = "layer.0",
    static_ctx: StaticForwardContext | None = None, seed: int = 0, mla: MLAConfig = MLA, scale: float = SCALE,
    sliding_window: int | None = None,
) -> MLAAttention:
    static_ctx = StaticForwardContext() if static_ctx is None else static_ctx
    layer = MLAAttention(name, mla, scale, attn_config, static_ctx, kv_cache_dtype=kv_cache_dtype,
                         sliding_window=sliding_window)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.kv_b_proj.weight.copy_(torch.randn(layer.kv_b_proj.weight.shape, generator=g) / mla.kv_lora_rank**0.5)
    layer.process_weights_after_loading()
    return layer


def make_batch(
    requests: list[Request], cache: torch.Tensor, block_size: int, seed: int = 0, mla: MLAConfig = MLA
) -> Batch:
    """Fill the cache (NaN everywhere unused) with each request's context in randomly permuted blocks."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = cache.shape[0]
    perm = torch.randperm(num_blocks, generator=g)
    blocks_needed = [-(-r.seq_len // block_size) for r in requests]
    if sum(blocks_needed) > num_blocks:
        raise ValueError("cache too small for the test batch")
    block_table = torch.zeros(len(requests), max(blocks_needed), dtype=torch.int32)
    offset = 0
    for i, nb in enumerate(blocks_needed):
        block_table[i, :nb] = perm[offset : offset + nb]
        offset += nb
    return fill_batch(requests, cache, block_table, block_size, g, mla=mla)


def fill_batch(
    requests: list[Request], cache: torch.Tensor, block_table: torch.Tensor, block_size: int, g: torch.Generator,
    write_new: bool = False, mla: MLAConfig = MLA,
) -> Batch:
    """Random latents, rope keys and queries for each request, its context stored at the slots `block_table` gives
    (NaN everywhere else); `write_new` also stores the new tokens' rows, as the layer does before a decode backend."""
    cache.fill_(float("nan"))
    flat = cache.view(-1, cache.shape[-1])
    c_all, pe_all, q_all, slots = [], [], [], []
    for i, r in enumerate(requests):
        c = torch.randn(r.seq_len, mla.kv_lora_rank, generator=g)
        k_pe = torch.randn(r.seq_len, mla.qk_rope_head_dim, generator=g)
        positions = torch.arange(r.seq_len)
        req_slots = block_table[i, positions // block_size].long() * block_size + positions % block_size
        written = r.seq_len if write_new else r.context_len
        flat[req_slots[:written]] = torch.cat([c, k_pe], -1)[:written].to(cache.dtype)
        slots.append(req_slots[r.context_len :])
        c_all.append(c)
        pe_all.append(k_pe)
        q_all.append(torch.randn(r.query_len, mla.num_heads, mla.qk_head_dim, generator=g))
    common = CommonAttentionMetadata.from_lists(
        [r.query_len for r in requests], [r.seq_len for r in requests], block_table, torch.cat(slots)
    )
    return Batch(requests, c_all, pe_all, q_all, common)


def naive_mla(layer: MLAAttention, batch: Batch, cache_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per request: decompress every position, attend with mask [ones(context) | tril(new)], in fp32; with the
    layer's sliding window W, query position p sees key positions p-W+1..p only."""
    m = layer.mla
    w = layer.kv_b_proj.weight.detach().float().view(m.num_heads, m.qk_nope_head_dim + m.v_head_dim, -1)
    outs = []
    for r, c, k_pe, q in zip(batch.requests, batch.c, batch.k_pe, batch.q):
        # What the cache holds is what attention sees: round through the cache dtype.
        c = c.to(cache_dtype).float()
        k_pe = k_pe.to(cache_dtype).float()
        kv = torch.einsum("sl,nhl->snh", c, w)
        k = torch.cat([kv[..., : m.qk_nope_head_dim], k_pe[:, None, :].expand(-1, m.num_heads, -1)], -1)
        v = kv[..., m.qk_nope_head_dim :]
        mask = torch.cat(
            [torch.ones(r.query_len, r.context_len), torch.ones(r.query_len, r.query_len).tril()], dim=1
        ).bool()
        if layer.sliding_window is not None:
            behind = torch.arange(r.context_len, r.seq_len)[:, None] - torch.arange(r.seq_len)[None, :]
            mask &= behind < layer.sliding_window
        scores = torch.einsum("qnd,snd->nqs", q.float(), k) * layer.scale
        scores = scores.masked_fill(~mask, float("-inf"))
        outs.append(torch.einsum("nqs,snv->qnv", scores.softmax(-1), v).flatten(1))
    return torch.cat(outs)


def run_layer(layer: MLAAttention, builder: MLAMetadataBuilder, batch: Batch) -> torch.Tensor:
    md = builder.build(batch.common)
    with set_forward_context(ForwardContext({layer.layer_name: md})):
        return layer(*batch.new_token_inputs())


def setup(
    attn_config: AttentionConfig, num_blocks: int, kv_cache_dtype: torch.dtype = torch.float32
) -> tuple[MLAAttention, MLAMetadataBuilder, torch.Tensor]:
    static_ctx = StaticForwardContext()
    layer = make_layer(attn_config, kv_cache_dtype, static_ctx=static_ctx)
    caches = allocate_kv_caches(static_ctx, num_blocks, attn_config.block_size, kv_cache_dtype)
    builder = MLAMetadataBuilder([layer.layer_name], static_ctx, attn_config)
    return layer, builder, caches[layer.layer_name]
