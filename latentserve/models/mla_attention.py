"""`DeepseekAttention`: the MLA projections (q, latent kv, rope, o_proj) of a DeepSeek-shaped layer around its
attention core (plain MLA, or sparse with an indexer: models/dsa.py)."""
from __future__ import annotations

import torch
from torch import nn

from latentserve.attention.dsa.indexer import IndexerInputs
from latentserve.config import AttentionConfig
from latentserve.forward_context import StaticForwardContext
from latentserve.kernels.native import MLABlock
from latentserve.layers.linear import Linear
from latentserve.layers.norm import RMSNorm
from latentserve.layers.query_scaling import LogPositionQueryScaling
from latentserve.layers.rotary import RotaryEmbedding
from latentserve.models.config import ModelConfig
from latentserve.models.dsa import attention_core
from latentserve.models.native_view import NativeView


def attention_layer_name(layer_idx: int) -> str:
    return f"model.layers.{layer_idx}.self_attn.attn"


def scale_queries(q: torch.Tensor, q_scale: torch.Tensor | None) -> torch.Tensor:
    """q `[T, N, D]` times each token's multiplier `[T]`, or each token's and head's `[T, N]` (None: as it is).
    Before the rotation rather than after, as transformers does: the rotation is linear."""
    return q if q_scale is None else q * q_scale.to(q.dtype).view(q.shape[0], -1, 1)


class DeepseekAttention(nn.Module):
    """The MLA projections (q, latent kv, rope, o_proj) around the paged attention core."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        attn_config: AttentionConfig,
        static_ctx: StaticForwardContext,
        dtype: torch.dtype,
        device: torch.device | str,
        name: str | None = None,  # its attention layer's (metadata and KV cache key); None: attention_layer_name
    ) -> None:
        super().__init__()
        c = config
        self.num_heads = c.num_attention_heads
        self.qk_nope_head_dim = c.qk_nope_head_dim
        self.qk_rope_head_dim = c.qk_rope_head_dim
        self.kv_lora_rank = c.kv_lora_rank
        self.q_lora = c.q_lora_rank is not None
        q_out = c.num_attention_heads * c.qk_head_dim
        if self.q_lora:
            self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, bias=c.attention_bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank)
            self.q_b_proj = Linear(c.q_lora_rank, q_out, bias=False)
        else:
            self.q_proj = Linear(c.hidden_size, q_out, bias=False)
        # A layer reading an earlier layer's latent cache (Mistral Large 4) projects no latent of its own.
        self.reads_kv = not c.owns_kv(layer_idx)
        if not self.reads_kv:
            self.kv_a_proj_with_mqa = Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim,
                                             bias=c.attention_bias)
            self.kv_a_layernorm = RMSNorm(c.kv_lora_rank)
        self.o_proj = Linear(c.num_attention_heads * c.v_head_dim, c.hidden_size, bias=c.attention_bias)
        self.rotary_emb = rotary_emb  # shared by all layers
        # Mistral Large 4: this layer's learned per-head query scaling, from the model's log positions
        self.softmax_scaling = LogPositionQueryScaling(c.num_attention_heads) if c.log_position_query_scaling \
            else None
        # the native kernel's view of the block, for the one-call decode path (`attention_block`)
        self.fused_block: NativeView[tuple[MLABlock, int]] = NativeView()
        self.attn = attention_core(c, attention_layer_name(layer_idx) if name is None else name, layer_idx,
                                   attn_config, static_ctx, dtype, device)
        if self.reads_kv:
            self.attn.kv_source = attention_layer_name(c.kv_source(layer_idx))
            self.native_block = False  # the one-call block computes a latent of the layer's own

    native_block = True  # the one-call decode block (attention_block.py) computes this module

    def forward(self, cos: torch.Tensor, sin: torch.Tensor, hidden: torch.Tensor,
                q_scale: torch.Tensor | None = None) -> torch.Tensor:
        """cos, sin `[T, R/2]`: the tokens' rotary angles, computed once per forward for all layers; q_scale `[T]`:
        each token's query multiplier, where the model scales queries by position (Mistral 4), or with this
        layer's own scaling (Mistral Large 4) each token's log(position + 1), which it turns into per-head ones."""
        q, q_resid = self.project_q(hidden)
        if self.softmax_scaling is not None:
            q_scale = self.softmax_scaling(q_scale)
        return self.o_proj(self.attend(cos, sin, hidden, scale_queries(q, q_scale), q_resid))

    def project_q(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(queries `[T, N, qk_head_dim]`, q's LoRA residual or None)."""
        q_resid = None
        if self.q_lora:
            q_resid = self.q_a_layernorm(self.q_a_proj(hidden))
            q = self.q_b_proj(q_resid)
        else:
            q = self.q_proj(hidden)
        return q.view(hidden.shape[0], self.num_heads, -1), q_resid

    def attend(self, cos: torch.Tensor, sin: torch.Tensor, hidden: torch.Tensor, q: torch.Tensor,
               q_resid: torch.Tensor | None) -> torch.Tensor:
        """The attention output `[T, N * V]` before o_proj, for queries `q` `[T, N, qk_head_dim]` (q's LoRA
        residual `q_resid` is the DSA indexer's input)."""
        if self.reads_kv:
            return self.attend_shared(cos, sin, hidden, q, q_resid)
        kv = self.kv_a_proj_with_mqa(hidden)
        out = self.attn.forward_projected(q, kv, self.kv_a_layernorm, self.rotary_emb, cos, sin)
        if out is None:
            latent, k_pe = kv.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
            kv_c_normed = self.kv_a_layernorm(latent)
            q_pe = q[..., self.qk_nope_head_dim :]
            # k_pe rides along as one more head: one rotation instead of two.
            pe = self.rotary_emb.rotate(torch.cat([q_pe, k_pe.unsqueeze(1)], dim=1), cos[:, None], sin[:, None])
            q_pe.copy_(pe[:, :-1])  # q is this layer's own buffer: rotate its rope dims in place, no new q
            # DSA's indexer scores from the layer's input and q's LoRA residual too.
            sparse = () if self.attn.index_topk is None else (IndexerInputs(hidden, q_resid, cos, sin),)
            out = self.attn(q, kv_c_normed, pe[:, -1], *sparse)
        return out

    def attend_shared(self, cos: torch.Tensor, sin: torch.Tensor, hidden: torch.Tensor, q: torch.Tensor,
                      q_resid: torch.Tensor | None) -> torch.Tensor:
        """`attend` for a layer reading its source layer's cache: the tokens' latents and rotated rope keys are the
        rows the source wrote; only q's rope dims rotate here."""
        kv_c_normed, k_pe = self.attn.read_new_rows(q.dtype)  # (a cache of another dtype)
        q_pe = q[..., self.qk_nope_head_dim :]
        q_pe.copy_(self.rotary_emb.rotate(q_pe, cos[:, None], sin[:, None]))
        sparse = () if self.attn.index_topk is None else (IndexerInputs(hidden, q_resid, cos, sin),)
        return self.attn(q, kv_c_normed, k_pe, *sparse)
