"""The DeepSeek-shaped MLA model on latentserve's paged attention, which every architecture (models/arch/) runs:
its layers' variants are chosen by `ModelConfig` fields.

Module and parameter names follow the checkpoints (`model.layers.{i}.self_attn.q_a_proj`, ...), except
`kv_b_proj`, which lives in the attention core: `model.layers.{i}.self_attn.attn.kv_b_proj`.
"""
from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from itertools import islice
from typing import Callable, Iterator

import torch
from torch import nn

from latentserve.attention.linear.kda import KimiDeltaAttention
from latentserve.config import AttentionConfig
from latentserve.forward_context import StaticForwardContext
from latentserve.kernels.policy import KernelPolicy
from latentserve.layers.embedding import ScaledEmbedding
from latentserve.layers.gated_norm import GatedRMSNorm
from latentserve.layers.hyper_connection import HyperConnection, HyperHead, add_to_streams
from latentserve.layers.linear import Linear
from latentserve.layers.logit_softcap import softcap
from latentserve.layers.mhc import MHCConnection, mean_of_streams, mix_streams
from latentserve.layers.mlp import GatedMLP
from latentserve.layers.moe import MoE
from latentserve.layers.norm import RMSNorm
from latentserve.layers.normed_moe import NormedMoE
from latentserve.layers.query_scaling import Llama4QueryScaling, log_positions
from latentserve.layers.rotary import RotaryEmbedding
from latentserve.models.attention_block import Built as AttentionBuilt
from latentserve.models.attention_block import fused_attention, native_block
from latentserve.models.config import ModelConfig
from latentserve.models.dots_attention import Dots3Attention
from latentserve.models.gated_attention import HeadGateAttention, HiddenGateAttention, QGateAttention
from latentserve.models.mla_attention import DeepseekAttention, attention_layer_name
from latentserve.models.decode_layers import LayerRun, layer_run, run_layers
from latentserve.models.moe_block import Built as MoEBuilt
from latentserve.models.moe_block import fused_moe, native_dense, native_moe
from latentserve.models.native_view import NativeView
from latentserve.models.shortcut_layer import ShortcutMoEDecoderLayer


def linear_attention_layer_name(layer_idx: int) -> str:
    return f"model.layers.{layer_idx}.self_attn"


def build_attention(config: ModelConfig, layer_idx: int, rotary_emb: RotaryEmbedding, attn_config: AttentionConfig,
                    static_ctx: StaticForwardContext, dtype: torch.dtype, device: torch.device | str,
                    name: str | None = None) -> DeepseekAttention | KimiDeltaAttention:
    """The layer's attention module: a hybrid's linear attention where its layer_types say so (docs/hybrids.md); else
    DeepSeek's MLA, or MLA with an output gate (A.X K2's from the fused q projection, Hunyuan V4's from the layer's
    input, Ling's one per head, dots3_note's per head with a normed rope key); `name`: its MLA layer's, where the
    layer has several (LongCat-Flash)."""
    c = config.layer_config(layer_idx)
    if c.is_linear_attention_layer(layer_idx):
        return KimiDeltaAttention(linear_attention_layer_name(layer_idx), c.hidden_size, c.linear_attention,
                                  c.rms_norm_eps, attn_config)
    kind = (Dots3Attention if c.k_rope_norm else QGateAttention if c.q_output_gate
            else HiddenGateAttention if c.hidden_output_gate else HeadGateAttention if c.head_output_gate
            else DeepseekAttention)
    return kind(c, layer_idx, rotary_emb, attn_config, static_ctx, dtype, device, name)


def attend(attention: nn.Module, cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor,
           q_scale: torch.Tensor | None) -> torch.Tensor:
    """A layer's attention over its normed input `x`; position-scaled queries (`q_scale`, Mistral 4) only where the
    model has them, and then MLA takes them."""
    return attention(cos, sin, x) if q_scale is None else attention(cos, sin, x, q_scale)


def _norm(config: ModelConfig, gated: bool) -> nn.Module:
    """A decoder layer's norm: gated where the config has gated norms (A.X K2: the input norm, the MoE's norm)."""
    if gated and config.gated_norm_rank is not None:
        return GatedRMSNorm(config.hidden_size, config.gated_norm_rank, eps=config.rms_norm_eps)
    return RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class DeepseekDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int, attention: DeepseekAttention | KimiDeltaAttention
    ) -> None:
        super().__init__()
        c = config
        self.self_attn = attention
        dense_limit = c.swiglu_limit if c.swiglu_limit_everywhere else None
        if c.is_moe_layer(layer_idx) and c.moe_output_norm:
            self.mlp = NormedMoE(c.hidden_size, c.moe_intermediate_size, c.routing, c.n_shared_experts, c.rms_norm_eps)
        elif c.is_moe_layer(layer_idx):
            self.mlp = MoE(c.hidden_size, c.moe_intermediate_size, c.routing, c.n_shared_experts, c.mlp_bias,
                           c.swiglu_limit, dense_limit, c.shared_expert_intermediate_size)
        else:
            self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, bias=c.mlp_bias, swiglu_limit=dense_limit)
        self.input_layernorm = _norm(c, gated=True)
        self.post_attention_layernorm = _norm(c, gated=c.is_moe_layer(layer_idx))
        self.moe_view: NativeView = NativeView()  # the MoE (or dense MLP) as moe_block.c reads it

    native_blocks = True  # its forward takes the one-call decode blocks (attention_block.py, moe_block.py)

    def process_weights_after_loading(self, policy: KernelPolicy) -> None:
        """Builds the one-call decode blocks of this layer once, chaining what its modules chose from `policy` (the
        loader processes them first); a weight replaced later rebuilds them (`NativeView`)."""
        if policy.kernels is None or not self.native_blocks:
            return
        dtype = next(self.input_layernorm.parameters()).dtype  # the activations' (a gated norm has no `weight`)
        if isinstance(self.self_attn, DeepseekAttention):
            native_block(self.self_attn, (self.input_layernorm, self.post_attention_layernorm), dtype)
        if isinstance(self.mlp, MoE):
            native_moe(self.mlp, self.moe_view, dtype)

    def decode_blocks(self, dtype: torch.dtype) -> tuple[AttentionBuilt, MoEBuilt] | None:
        """Its one-call attention and MoE blocks for `dtype` activations (a dense MLP as the MoE block of no routed
        experts, for one token) where a decode step's forward is exactly the two (decode_layers.py chains them), else
        None."""
        if not self.native_blocks or not isinstance(self.self_attn, DeepseekAttention) or \
                isinstance(self.mlp, NormedMoE):
            return None  # (NormedMoE: a norm between the experts' sum and the residual)
        if isinstance(self.mlp, MoE):
            mlp = native_moe(self.mlp, self.moe_view, dtype)
        elif type(self.mlp) is GatedMLP:
            mlp = native_dense(self.mlp, self.moe_view, dtype)
        else:
            return None
        attention = native_block(self.self_attn, (self.input_layernorm, self.post_attention_layernorm), dtype)
        return None if attention is None or mlp is None else (attention, mlp)

    def forward(self, cos: torch.Tensor, sin: torch.Tensor, hidden: torch.Tensor,
                q_scale: torch.Tensor | None = None) -> torch.Tensor:
        norms = (self.input_layernorm, self.post_attention_layernorm)
        # decode: one native call, which has no query scaling
        fused = fused_attention(self.self_attn, norms, cos, sin, hidden) if q_scale is None else None
        if fused is not None:
            hidden, normed = fused
        else:
            hidden = hidden + attend(self.self_attn, cos, sin, self.input_layernorm(hidden), q_scale)
            normed = self.post_attention_layernorm(hidden)
        if isinstance(self.mlp, MoE) and (out := fused_moe(self.mlp, self.moe_view, normed, hidden)) is not None:
            return out  # decode: one native call
        return hidden + self.mlp(normed)


class ScaledResidualDecoderLayer(DeepseekDecoderLayer):
    """MiniCPM3's layer: each sublayer's output scaled before its residual add. The one-call decode blocks add it
    unscaled, so this layer runs its modules."""

    native_blocks = False

    def __init__(self, config: ModelConfig, layer_idx: int, attention: DeepseekAttention) -> None:
        super().__init__(config, layer_idx, attention)
        self.residual_scale = config.residual_scale

    def forward(self, cos: torch.Tensor, sin: torch.Tensor, hidden: torch.Tensor,
                q_scale: torch.Tensor | None = None) -> torch.Tensor:
        hidden = hidden + attend(self.self_attn, cos, sin, self.input_layernorm(hidden), q_scale) * self.residual_scale
        return hidden + self.mlp(self.post_attention_layernorm(hidden)) * self.residual_scale


class HyperConnectedDecoderLayer(DeepseekDecoderLayer):
    """A decoder layer over hyper-connected residual streams `[T, n, H]` (layers/hyper_connection.py). It never
    takes the one-call decode blocks, which add their block's output to one plain residual."""

    native_blocks = False

    def __init__(self, config: ModelConfig, layer_idx: int, attention: DeepseekAttention) -> None:
        super().__init__(config, layer_idx, attention)
        self.attn_hc = HyperConnection(config.hidden_size, config.hyper_connections)
        self.ffn_hc = HyperConnection(config.hidden_size, config.hyper_connections)

    def forward(self, cos: torch.Tensor, sin: torch.Tensor, streams: torch.Tensor,
                q_scale: torch.Tensor | None = None) -> torch.Tensor:
        post, x = self.attn_hc(streams)
        streams = add_to_streams(streams, post, attend(self.self_attn, cos, sin, self.input_layernorm(x), q_scale))
        post, x = self.ffn_hc(streams)
        return add_to_streams(streams, post, self.mlp(self.post_attention_layernorm(x)))


class MHCDecoderLayer(DeepseekDecoderLayer):
    """A decoder layer over mHC streams `[T, n, H]` (layers/mhc.py): hyper-connections whose streams are also mixed
    with each other. Like `HyperConnectedDecoderLayer`, it never takes the one-call decode blocks."""

    native_blocks = False

    def __init__(self, config: ModelConfig, layer_idx: int, attention: DeepseekAttention | KimiDeltaAttention) -> None:
        super().__init__(config, layer_idx, attention)
        self.attn_hc = MHCConnection(config.hidden_size, config.hyper_connections)
        self.ffn_hc = MHCConnection(config.hidden_size, config.hyper_connections)

    def forward(self, cos: torch.Tensor, sin: torch.Tensor, streams: torch.Tensor,
                q_scale: torch.Tensor | None = None) -> torch.Tensor:
        post, comb, x = self.attn_hc(streams)
        streams = mix_streams(streams, post, comb, attend(self.self_attn, cos, sin, self.input_layernorm(x), q_scale))
        post, comb, x = self.ffn_hc(streams)
        return mix_streams(streams, post, comb, self.mlp(self.post_attention_layernorm(x)))


def _decoder_layer(c: ModelConfig, i: int, attention: Callable[..., nn.Module]) -> nn.Module:
    """Layer i of the model's kind, its attention built by `attention(i, name=...)`."""
    if c.shortcut_moe:
        return ShortcutMoEDecoderLayer(c, [attention(i, name=f"model.layers.{i}.self_attn.{j}.attn") for j in (0, 1)])
    if c.hyper_connections is not None:
        kind = MHCDecoderLayer if c.hyper_connections.sinkhorn_iters else HyperConnectedDecoderLayer
        return kind(c, i, attention(i))
    layer_cls = DeepseekDecoderLayer if c.residual_scale == 1.0 else ScaledResidualDecoderLayer
    return layer_cls(c, i, attention(i))


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
        self.embed_tokens = (nn.Embedding(c.vocab_size, c.hidden_size) if c.embedding_scale == 1.0
                             else ScaledEmbedding(c.vocab_size, c.hidden_size, c.embedding_scale))
        # One rotary embedding per distinct rope (dots3_note's sliding layers rotate their own dims at their own
        # theta); each layer's index into them, so each one's angles are computed once per forward.
        ropes = list(dict.fromkeys((lc.qk_rope_head_dim, lc.rope) for lc in map(c.layer_config,
                                                                                range(c.num_hidden_layers))))
        self.rotary_embs = nn.ModuleList(RotaryEmbedding(dim, rope, c.rope_style,
                                                        c.learned_rope_freq_scale and dim > 0) for dim, rope in ropes)
        self.layer_rotary = [ropes.index((lc.qk_rope_head_dim, lc.rope))
                             for lc in map(c.layer_config, range(c.num_hidden_layers))]
        attention = partial(build_attention, c, attn_config=attn_config, static_ctx=static_ctx, dtype=dtype,
                            device=device)
        self.layers = nn.ModuleList(_decoder_layer(c, i, partial(attention, rotary_emb=self.rotary_embs[r]))
                                    for i, r in enumerate(self.layer_rotary))
        hc = c.hyper_connections
        # The streams' number (None: one plain residual) and how they become one hidden state at the end.
        self.streams = None if hc is None else hc.streams
        self.hc_head = None if hc is None else mean_of_streams if hc.sinkhorn_iters else HyperHead(c.hidden_size, hc)
        self.norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.run_view: NativeView[LayerRun] = NativeView()  # the last layers as decode_layers.c reads them
        self.rope_free = c.rope_free
        self.query_scaling = log_positions if c.log_position_query_scaling else None if c.llama4_scaling_beta is None \
            else Llama4QueryScaling(c.llama4_scaling_beta, c.rope.original_max_position_embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        if self.streams is not None:  # every stream starts as the embedding
            hidden = hidden.unsqueeze(1).expand(-1, self.streams, -1).contiguous()
        # Without positions every token rotates by angle 0 (cos 1, sin 0: exactly the identity), so the rotary path
        # and the kernels that fuse it stay as they are.
        angles = [rotary.cos_sin(torch.zeros_like(positions) if self.rope_free else positions)
                  for rotary in self.rotary_embs]
        q_scale = None if self.query_scaling is None else self.query_scaling(positions)
        # decode: the last layers in one native call where each would take its one-call blocks
        run = layer_run(self.run_view, self.layers, self.layer_rotary, hidden) if q_scale is None else None
        for layer, r in islice(zip(self.layers, self.layer_rotary), len(self.layers) if run is None else run.first):
            hidden = layer(*angles[r], hidden, q_scale)
        if run is not None:  # the final norm in the same call where it runs the run's kernels
            norm = None if self.hc_head is not None else self.norm.native_norm(run.cores[0].kernels, hidden.dtype)
            hidden = run_layers(run, *angles[run.rotary], hidden, norm)
            if norm is not None:
                return hidden
        if self.hc_head is not None:
            hidden = self.hc_head(hidden)
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
        with torch.device(device), _default_dtype(dtype):
            self.model = DeepseekModel(config, attn_config, self.static_forward_context, dtype, device)
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.attention_layer_names = list(self.static_forward_context)  # the MLA layers, in layer order
        # Hybrid models' linear-attention layers, by name: each keeps a state per request (engine/state_pool.py).
        self.state_layers: dict[str, KimiDeltaAttention] = {
            m.layer_name: m for m in self.model.modules() if isinstance(m, KimiDeltaAttention)}
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
        if self.config.logits_scaling != 1.0:
            hidden = hidden / self.config.logits_scaling
        return softcap(self.lm_head(hidden).float(), self.config.final_logit_softcapping)
