"""`Dots3Attention` (dots3_note): Ling's per-head sigmoid output gate (`HeadGateAttention`) over MLA whose normed
LoRA latents are scaled by sqrt(hidden / rank) (q's before q_b_proj and the indexer, kv's before the cache) and whose
shared rope key has its own RMSNorm (`k_rope_norm`) before the rotation."""
from __future__ import annotations

import torch

from latentserve.attention.dsa.indexer import IndexerInputs
from latentserve.layers.norm import RMSNorm
from latentserve.models.gated_attention import HeadGateAttention


class Dots3Attention(HeadGateAttention):
    def __init__(self, config, *args, **kwargs) -> None:
        c = config
        if c.q_lora_rank is None:
            raise ValueError("config.json: field 'q_lora_rank' must be set: dots3_note scales q's LoRA latent")
        super().__init__(config, *args, **kwargs)
        eps = c.rms_norm_eps  # every norm of the layer takes the model's eps
        self.q_a_layernorm.eps = self.kv_a_layernorm.eps = eps
        self.k_rope_norm = RMSNorm(c.qk_rope_head_dim, eps=eps)
        self.q_lora_scale = (c.hidden_size / c.q_lora_rank) ** 0.5 if c.lora_scales else 1.0
        self.kv_lora_scale = (c.hidden_size / c.kv_lora_rank) ** 0.5 if c.lora_scales else 1.0

    def project_q(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        q_resid = self.q_a_layernorm(self.q_a_proj(hidden)) * self.q_lora_scale
        return self.q_b_proj(q_resid).view(hidden.shape[0], self.num_heads, -1), q_resid

    def attend(self, cos: torch.Tensor, sin: torch.Tensor, hidden: torch.Tensor, q: torch.Tensor,
               q_resid: torch.Tensor | None) -> torch.Tensor:
        # The torch ops throughout: the native prologue (`forward_projected`) has neither the scale nor the key norm.
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pe = k_pe.contiguous()
        kv_c_normed = self.kv_a_layernorm(latent) * self.kv_lora_scale
        q_pe = q[..., self.qk_nope_head_dim:]
        pe = self.rotary_emb.rotate(torch.cat([q_pe, self.k_rope_norm(k_pe).unsqueeze(1)], dim=1),
                                    cos[:, None], sin[:, None])
        q_pe.copy_(pe[:, :-1])
        sparse = () if self.attn.index_topk is None else (IndexerInputs(hidden, q_resid, cos, sin),)
        return self.attn(q, kv_c_normed, pe[:, -1], *sparse)
