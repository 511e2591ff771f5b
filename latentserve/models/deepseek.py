"""DeepSeek-V2 / V2-Lite / V3 on latentserve's paged MLA attention.

Module and parameter names follow the checkpoints (`model.layers.{i}.self_attn.q_a_proj`, ...), except
`kv_b_proj`, which lives in the attention core: `model.layers.{i}.self_attn.attn.kv_b_proj`.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from latentserve.attention.dsa.indexer import IndexerInputs
from latentserve.config import AttentionConfig
from latentserve.forward_context import StaticForwardContext
from latentserve.kernels.native import MLABlock
from latentserve.layers.linear import Linear
from latentserve.layers.mlp import GatedMLP
from latentserve.layers.moe import MoE
from latentserve.layers.normed_moe import NormedMoE
from latentserve.layers.norm import RMSNorm
from latentserve.layers.rotary import RotaryEmbedding
from latentserve.models.attention_block import fused_attention
from latentserve.models.moe_block import fused_moe
from latentserve.models.native_view import NativeView
from latentserve.models.config import ModelConfig
from latentserve.models.dsa import attention_core


def attention_layer_name(layer_idx: int) -> str:
    return f"model.layers.{layer_idx}.self_attn.attn"


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
        self.kv_a_proj_with_mqa = Linear(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=c.attention_bias)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank)
        self.o_proj = Linear(c.num_attention_heads * c.v_head_dim, c.hidden_size, bias=c.attention_bias)
        self.rotary_emb = rotary_emb  # shared by all layers
        # the native kernel's view of the block, for the one-call decode path (`attention_block`)
        self.fused_block: NativeView[tuple[MLABlock, int]] = NativeView()
        self.attn = attention_core(c, attention_layer_name(layer_idx), layer_idx, attn_config, static_ctx, dtype,
                                   device)

    def forward(self, cos: torch.Tensor, sin: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """cos, sin `[T, R/2]`: the tokens' rotary angles, computed once per forward for all layers."""
        q_resid = None
        if self.q_lora:
            q_resid = self.q_a_layernorm(self.q_a_proj(hidden))
            q = self.q_b_proj(q_resid)
        else:
            q = self.q_proj(hidden)
        q = q.view(hidden.shape[0], self.num_heads, -1)
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
        return self.o_proj(out)


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, attention: DeepseekAttention) -> None:
        super().__init__()
        c = config
        self.self_attn = attention
        if c.is_moe_layer(layer_idx) and c.moe_output_norm:
            self.mlp = NormedMoE(c.hidden_size, c.moe_intermediate_size, c.routing, c.n_shared_experts, c.rms_norm_eps)
        elif c.is_moe_layer(layer_idx):
            self.mlp = MoE(c.hidden_size, c.moe_intermediate_size, c.routing, c.n_shared_experts, c.mlp_bias)
        else:
            self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.input_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.moe_view: NativeView = NativeView()  # the MoE as moe_block.c reads it

    def forward(self, cos: torch.Tensor, sin: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        norms = (self.input_layernorm, self.post_attention_layernorm)
        fused = fused_attention(self.self_attn, norms, cos, sin, hidden)  # decode: one native call
        if fused is not None:
            hidden, normed = fused
        else:
            hidden = hidden + self.self_attn(cos, sin, self.input_layernorm(hidden))
            normed = self.post_attention_layernorm(hidden)
        if isinstance(self.mlp, MoE) and (out := fused_moe(self.mlp, self.moe_view, normed, hidden)) is not None:
            return out  # decode: one native call
        return hidden + self.mlp(normed)


class DeepseekModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        attn_config: AttentionConfig,
        static_ctx: StaticForwardContext,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.rotary_emb = RotaryEmbedding(c.qk_rope_head_dim, c.rope, c.rope_style)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(
                c, i, DeepseekAttention(c, i, self.rotary_emb, attn_config, static_ctx, dtype, device)
            )
            for i in range(c.num_hidden_layers)
        )
        self.norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb.cos_sin(positions)
        for layer in self.layers:
            hidden = layer(cos, sin, hidden)
        return self.norm(hidden)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Create parameters directly in the compute dtype (modules that need fp32 ask for it)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class DeepseekForCausalLM(nn.Module):
    """A flat batch of tokens in, hidden states out; attention metadata comes from the forward context."""

    def __init__(
        self,
        config: ModelConfig,
        attn_config: AttentionConfig = AttentionConfig(),
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        if not dtype.is_floating_point:
            raise ValueError(f"model dtype must be a floating point type, got {dtype}")
        self.config = config
        self.mla_config = config.mla_config
        self.static_forward_context = StaticForwardContext()
        self.attention_layer_names = [attention_layer_name(i) for i in range(config.num_hidden_layers)]
        with torch.device(device), _default_dtype(dtype):
            self.model = DeepseekModel(config, attn_config, self.static_forward_context, dtype, device)
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions `[T]` -> final hidden states `[T, hidden_size]` (after the final norm)."""
        if input_ids.dim() != 1 or input_ids.dtype.is_floating_point:
            raise ValueError(f"input_ids must be a 1-D integer tensor, got {input_ids.dtype} {tuple(input_ids.shape)}")
        if positions.shape != input_ids.shape or positions.dtype.is_floating_point:
            raise ValueError(
                f"positions must be an integer tensor shaped like input_ids {tuple(input_ids.shape)}, "
                f"got {positions.dtype} {tuple(positions.shape)}"
            )
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[T, vocab_size]`."""
        return self.lm_head(hidden).float()
