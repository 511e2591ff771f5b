"""`KimiDeltaAttention`: a hybrid model's linear-attention layer (Kimi Delta Attention), over a state per request.

Where an MLA layer writes each token's latent to the paged cache, this layer folds its tokens into its request's
state slot (engine/state_pool.py): the short convolution's last inputs and the delta rule's matrix. The slot comes
from the step's metadata (`MLAMetadata.states`), so each ubatch touches only its own requests' slots. Parameter
names follow the checkpoints (`model.layers.{i}.self_attn.q_conv1d.weight`, `...f_a_proj.weight`, ...).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from latentserve.attention.linear.ops import causal_conv, delta_rule
from latentserve.attention.metadata import MLAMetadata, StateMetadata
from latentserve.attention.prefill.base import OwnershipError
from latentserve.config import AttentionConfig, LinearAttentionConfig
from latentserve.forward_context import get_forward_context
from latentserve.layers.linear import Linear


class KimiDeltaAttention(nn.Module):
    native_block = False  # no MLA: the one-call decode attention block (models/attention_block.py) declines it

    def __init__(
        self, layer_name: str, hidden_size: int, cfg: LinearAttentionConfig, eps: float, attn_config: AttentionConfig
    ) -> None:
        super().__init__()
        self.layer_name = layer_name
        self.cfg = cfg
        self.eps = eps
        self.debug = attn_config.debug_ownership
        c, d, h = cfg.qkv_dim, cfg.head_dim, cfg.num_heads
        self.q_proj = Linear(hidden_size, c, bias=False)
        self.k_proj = Linear(hidden_size, c, bias=False)
        self.v_proj = Linear(hidden_size, c, bias=False)
        self.q_conv1d = _DepthwiseConv(c, cfg.conv_kernel_size)
        self.k_conv1d = _DepthwiseConv(c, cfg.conv_kernel_size)
        self.v_conv1d = _DepthwiseConv(c, cfg.conv_kernel_size)
        if cfg.gate_lora:
            self.f_a_proj = Linear(hidden_size, d, bias=False)
            self.f_b_proj = Linear(d, c, bias=False)
            self.g_a_proj = Linear(hidden_size, d, bias=False)
            self.g_b_proj = Linear(d, c, bias=False)
        else:
            self.f_proj = Linear(hidden_size, c, bias=False)
            self.g_proj = Linear(hidden_size, c, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(c, dtype=torch.float32))  # fp32 in the checkpoints too
        self.A_log = nn.Parameter(torch.empty(1, 1, h, 1, dtype=torch.float32))
        self.b_proj = Linear(hidden_size, h, bias=False)
        self.o_norm = _GatedNorm(d, eps)
        self.o_proj = Linear(c, hidden_size, bias=False)
        # This layer's slices of the state pool, bound by the model runner (`bind_states`).
        self.conv_state: torch.Tensor | None = None  # [slots, 3 * qkv_dim, kernel - 1]
        self.recurrent_state: torch.Tensor | None = None  # [slots, H, K, V] fp32

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per slot: the conv state's shape and the recurrent state's."""
        c = self.cfg
        return (3 * c.qkv_dim, c.conv_kernel_size - 1), (c.num_heads, c.head_dim, c.head_dim)

    def bind_states(self, conv_state: torch.Tensor, recurrent_state: torch.Tensor) -> None:
        self.conv_state, self.recurrent_state = conv_state, recurrent_state

    def forward(self, cos: torch.Tensor, sin: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """hidden `[T, hidden_size]` (after the input norm) -> `[T, hidden_size]`; cos, sin unused (no positions:
        the state carries the order)."""
        md = self._metadata(hidden.shape[0])
        t, h, d = hidden.shape[0], self.cfg.num_heads, self.cfg.head_dim
        mixed = torch.cat([self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)], dim=-1)
        g = self._forget_gate(hidden)
        beta = torch.sigmoid(self.b_proj(hidden))
        weight = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])[:, 0]
        core = hidden.new_empty(t, h, d)
        qsl, contexts = md.query_start_loc_cpu, md.context_lens_cpu
        # Decodes (one token over some context; the batch puts them first) step together, each prefill on its own.
        num_decodes = next((i for i in range(len(md.slots)) if qsl[i + 1] - qsl[i] != 1 or contexts[i] == 0),
                           len(md.slots))
        groups = ([range(num_decodes)] if num_decodes else []) + [range(i, i + 1) for i in
                                                                  range(num_decodes, len(md.slots))]
        for reqs in groups:
            tokens = slice(qsl[reqs.start], qsl[reqs.stop])
            slots = torch.tensor(md.slots[reqs.start : reqs.stop], device=hidden.device)
            fresh = contexts[reqs.start] == 0  # a new (or recomputed) request starts from zero
            conv0, state0 = self.conv_state[slots], self.recurrent_state[slots]
            if fresh:  # (copies of the slots: the pool itself is written below)
                conv0.zero_()
                state0.zero_()
            b = len(reqs)
            x, self.conv_state[slots] = causal_conv(mixed[tokens].view(b, -1, mixed.shape[-1]), weight, conv0)
            q, k, v = x.view(b, -1, 3, h, d).unbind(2)
            out, self.recurrent_state[slots] = delta_rule(q, k, v, g[tokens].view(b, -1, h, d),
                                                          beta[tokens].view(b, -1, h), state0)
            core[tokens] = out.reshape(-1, h, d)
        gate = (self.g_b_proj(self.g_a_proj(hidden)) if self.cfg.gate_lora else self.g_proj(hidden)).view(t, h, d)
        return self.o_proj(self.o_norm(core, gate).reshape(t, -1))

    def _forget_gate(self, hidden: torch.Tensor) -> torch.Tensor:
        """The per-channel log decay `[T, H, K]` (fp32, <= 0) of x = f(hidden) + dt_bias: -exp(A_log) * softplus(x),
        or with a lower bound b: b * sigmoid(exp(A_log) * x)."""
        h, d = self.cfg.num_heads, self.cfg.head_dim
        f = self.f_b_proj(self.f_a_proj(hidden)) if self.cfg.gate_lora else self.f_proj(hidden)
        x = (f.float() + self.dt_bias.float()).view(-1, h, d)
        rate = self.A_log.float().view(h, 1).exp()
        if self.cfg.gate_lower_bound is not None:
            return self.cfg.gate_lower_bound * torch.sigmoid(rate * x)
        return -rate * F.softplus(x, threshold=20.0)

    def _metadata(self, num_tokens: int) -> StateMetadata:
        if self.conv_state is None:
            raise RuntimeError(f"{self.layer_name}: bind the state pool (bind_states) before running the layer")
        ctx = get_forward_context()
        md: MLAMetadata | None = ctx.attn_metadata.get(self.layer_name)
        if md is None or md.states is None:
            raise RuntimeError(f"no state metadata for linear-attention layer {self.layer_name!r} in the forward "
                               "context (are the requests' state slots scheduled?)")
        if self.debug and ctx.ubatch_id is not None and md.builder_id != ctx.ubatch_id:
            raise OwnershipError(f"{self.layer_name}: ubatch {ctx.ubatch_id} is reading metadata built for ubatch "
                                 f"{md.builder_id}")
        if num_tokens != md.num_actual_tokens:
            raise ValueError(f"{self.layer_name}: got {num_tokens} tokens but the metadata describes "
                             f"{md.num_actual_tokens}")
        return md.states


class _DepthwiseConv(nn.Module):
    """The weight of a depthwise causal convolution, `[C, 1, K]` as checkpoints store nn.Conv1d's."""

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))


class _GatedNorm(nn.Module):
    """RMSNorm over each head, times sigmoid(gate), all in fp32 as the reference."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps)
        return (normed * torch.sigmoid(gate.float())).to(x.dtype)
