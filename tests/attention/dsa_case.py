"""DSA layers over a paged cache, run step by step as the engine would, and a reference built on transformers'
own indexer (DeepseekV32Indexer / GlmMoeDsaIndexer) with naive fp32 masked attention."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from latentserve.attention.builder import MLAMetadataBuilder
from latentserve.attention.dsa.indexer import Indexer, IndexerConfig, IndexerInputs
from latentserve.attention.dsa.layer import SparseMLAAttention
from latentserve.attention.kv_cache import allocate_kv_caches
from latentserve.attention.metadata import CommonAttentionMetadata
from latentserve.config import AttentionConfig
from latentserve.forward_context import StaticForwardContext
from latentserve.layers.rotary import RopeConfig, RotaryEmbedding
from tests.attention.mla_case import MLA, SCALE

# Enough indexer heads that no score is exactly 0 (every head negative after relu): ties at 0 would make the
# top-k order implementation-defined.
HIDDEN, Q_LORA, INDEX_HEADS, INDEX_DIM, ROPE = 24, 20, 16, 16, 8


def hf_indexer(interleaved: bool, topk: int, seed: int):
    """transformers' indexer for our shapes, with random weights (its LayerNorm too)."""
    from transformers import DeepseekV32Config
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaIndexer

    config = DeepseekV32Config(hidden_size=HIDDEN, q_lora_rank=Q_LORA, index_n_heads=INDEX_HEADS,
                               index_head_dim=INDEX_DIM, qk_rope_head_dim=ROPE, index_topk=topk,
                               num_hidden_layers=1)
    torch.manual_seed(seed)
    ref = (GlmMoeDsaIndexer if interleaved else DeepseekV32Indexer)(config, 0).float().eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape) * (0.5 if p.dim() > 1 else 0.3) + (1.0 if p.dim() == 1 else 0.0))
    return ref


def our_indexer(ref, interleaved: bool, topk: int) -> Indexer:
    ours = Indexer(IndexerConfig(HIDDEN, Q_LORA, INDEX_HEADS, INDEX_DIM, ROPE, topk, interleaved), RopeConfig())
    ours.load_state_dict(ref.state_dict())
    return ours


def make_layers(attn_config: AttentionConfig, topk: int, indexers: list[Indexer | None], num_blocks: int,
                seed: int = 0) -> tuple[list[SparseMLAAttention], StaticForwardContext]:
    static_ctx = StaticForwardContext()
    g = torch.Generator().manual_seed(seed)
    layers = []
    for i, indexer in enumerate(indexers):
        layer = SparseMLAAttention(f"layer.{i}", MLA, SCALE, attn_config, static_ctx, topk, indexer)
        with torch.no_grad():
            layer.kv_b_proj.weight.copy_(torch.randn(layer.kv_b_proj.weight.shape, generator=g) / MLA.kv_lora_rank**0.5)
        layer.process_weights_after_loading()
        layers.append(layer)
    for cache in allocate_kv_caches(static_ctx, num_blocks, attn_config.block_size, torch.float32).values():
        cache.fill_(float("nan"))  # a read of a slot nobody wrote poisons the output
    return layers, static_ctx


def builders(layers, static_ctx, attn_config: AttentionConfig, n: int = 1) -> list[MLAMetadataBuilder]:
    return [MLAMetadataBuilder([l.layer_name for l in layers], static_ctx, attn_config, "cpu", i) for i in range(n)]


@dataclass
class Sequence:
    """One request's whole sequence: per position the layer inputs (per layer: q, latent, k_pe)."""

    hidden: torch.Tensor
    q_resid: torch.Tensor
    q: list[torch.Tensor]
    c: list[torch.Tensor]
    k_pe: list[torch.Tensor]

    @property
    def length(self) -> int:
        return self.hidden.shape[0]


def make_sequences(lengths: list[int], num_layers: int, seed: int = 1) -> list[Sequence]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    return [Sequence(r(n, HIDDEN), r(n, Q_LORA), [r(n, MLA.num_heads, MLA.qk_head_dim) for _ in range(num_layers)],
                     [r(n, MLA.kv_lora_rank) for _ in range(num_layers)],
                     [r(n, MLA.qk_rope_head_dim) for _ in range(num_layers)]) for n in lengths]


def step_common(seqs: list[Sequence], reqs: list[int], spans: list[tuple[int, int]], block_tables: torch.Tensor,
                block_size: int) -> CommonAttentionMetadata:
    """A step of requests `reqs` (decodes first), request i computing positions spans[i] = (start, end)."""
    slots = []
    for r, (s, e) in zip(reqs, spans):
        pos = torch.arange(s, e)
        slots.append(block_tables[r, pos // block_size].long() * block_size + pos % block_size)
    width = block_tables.shape[1]
    return CommonAttentionMetadata.from_lists([e - s for s, e in spans], [e for _, e in spans],
                                              block_tables[reqs].reshape(len(reqs), width), torch.cat(slots))


def step_inputs(seqs, reqs, spans, layer_idx: int, rotary: RotaryEmbedding):
    pick = lambda f: torch.cat([f(seqs[r])[s:e] for r, (s, e) in zip(reqs, spans)])  # noqa: E731
    positions = torch.cat([torch.arange(s, e) for s, e in spans])
    cos, sin = rotary.cos_sin(positions)
    index_inputs = IndexerInputs(pick(lambda q: q.hidden), pick(lambda q: q.q_resid), cos, sin)
    return (pick(lambda q: q.q[layer_idx]), pick(lambda q: q.c[layer_idx]), pick(lambda q: q.k_pe[layer_idx]),
            index_inputs)


def reference_topk(ref, seq: Sequence) -> torch.Tensor:
    """transformers' indexer over the whole sequence: `[S, min(topk, S)]` positions."""
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32RotaryEmbedding

    n = seq.length
    rotary = DeepseekV32RotaryEmbedding(ref.config)
    cos, sin = rotary(seq.hidden[None], torch.arange(n)[None])
    mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None]
    with torch.no_grad():
        return ref(seq.hidden[None], seq.q_resid[None], (cos, sin), mask, None)[0]


def naive_sparse(layer: SparseMLAAttention, seq: Sequence, layer_idx: int, topk_positions: torch.Tensor | None):
    """fp32 attention of every position over its causal positions, restricted to the selected ones."""
    n = seq.length
    w = layer.kv_b_proj.weight.detach().float().view(MLA.num_heads, MLA.qk_nope_head_dim + MLA.v_head_dim, -1)
    kv = torch.einsum("sl,nhl->snh", seq.c[layer_idx], w)
    k = torch.cat([kv[..., : MLA.qk_nope_head_dim], seq.k_pe[layer_idx][:, None].expand(-1, MLA.num_heads, -1)], -1)
    v = kv[..., MLA.qk_nope_head_dim :]
    allowed = torch.ones(n, n).tril().bool()
    if topk_positions is not None:
        selected = torch.zeros(n, n, dtype=torch.bool).scatter(1, topk_positions.long(), True)
        allowed &= selected
    scores = torch.einsum("qnd,snd->nqs", seq.q[layer_idx], k) * SCALE
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("nqs,snv->qnv", scores.softmax(-1), v).flatten(1)
