"""A small stack of MLA layers with MLPs between them, yielding where MoE communication would."""
from __future__ import annotations

import torch
from torch import nn

import latentserve.attention.mla as mla_module
from latentserve.attention.builder import MLAMetadataBuilder
from latentserve.attention.kv_cache import allocate_kv_caches
from latentserve.attention.mla import MLAAttention
from latentserve.config import AttentionConfig
from latentserve.forward_context import StaticForwardContext, dbo_yield
from tests.attention.mla_case import MLA, SCALE

HIDDEN = 48


class Block(nn.Module):
    def __init__(self, name: str, attn_config: AttentionConfig, static_ctx: StaticForwardContext):
        super().__init__()
        m = MLA
        self.q = nn.Linear(HIDDEN, m.num_heads * m.qk_head_dim, bias=False)
        self.kv_a = nn.Linear(HIDDEN, m.kv_lora_rank + m.qk_rope_head_dim, bias=False)
        self.attn = MLAAttention(name, m, SCALE, attn_config, static_ctx)
        self.o = nn.Linear(m.num_heads * m.v_head_dim, HIDDEN, bias=False)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 96), nn.SiLU(), nn.Linear(96, HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x).view(-1, MLA.num_heads, MLA.qk_head_dim)
        c, k_pe = self.kv_a(x).split([MLA.kv_lora_rank, MLA.qk_rope_head_dim], -1)
        x = x + self.o(self.attn(q, c, k_pe))
        # Both yields run in every ubatch, whatever it holds: DBO needs equal yields per layer.
        dbo_yield()  # where a dispatch all-to-all would wait
        x = x + self.mlp(x)
        dbo_yield()  # where a combine would wait
        return x


class Stack(nn.Module):
    def __init__(self, num_layers: int, attn_config: AttentionConfig, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.static_ctx = StaticForwardContext()
        self.blocks = nn.ModuleList(Block(f"layers.{i}.attn", attn_config, self.static_ctx) for i in range(num_layers))
        for block in self.blocks:
            block.attn.process_weights_after_loading()
        self.attn_config = attn_config

    @property
    def layer_names(self) -> list[str]:
        return list(self.static_ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def allocate(self, num_blocks: int) -> dict[str, torch.Tensor]:
        return allocate_kv_caches(self.static_ctx, num_blocks, self.attn_config.block_size, torch.float32)

    def builders(self, n: int) -> list[MLAMetadataBuilder]:
        return [
            MLAMetadataBuilder(self.layer_names, self.static_ctx, self.attn_config, builder_id=i) for i in range(n)
        ]


def yield_after_context_gather(monkeypatch) -> None:
    """Yield between a context gather and its use: the other ubatch runs there, as on a second CUDA stream. Only
    prefills with context gather, so their ubatch yields once more per layer than the other."""
    gather = mla_module.gather_kv_cache

    def gather_then_yield(*args, **kwargs):
        rows = gather(*args, **kwargs)
        dbo_yield()
        return rows

    monkeypatch.setattr(mla_module, "gather_kv_cache", gather_then_yield)
