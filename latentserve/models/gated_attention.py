"""MLA with a sigmoid gate on the attention output, before o_proj, one value per head and value dim.

`QGateAttention` (A.X K2): the gate and the query come from one fused projection. `q_b_proj` reads q's LoRA residual beside the un-normed LoRA activation, `[q_resid ‖ q_a]`, and writes, per head,
the query `[qk_head_dim]` then a gate `[v_head_dim]`; the attention output is multiplied by the gate's sigmoid before
o_proj. The checkpoints keep the projection fused (its FP8 block scales span both halves), and so does the model.

`HiddenGateAttention` (Hunyuan V4): the gate is its own projection of the layer's input, `gate_proj`.

`HeadGateAttention` (Ling hybrids): one gate value per head, `g_proj` of the layer's input, shared by the head's value
dims."""
from __future__ import annotations

import torch

from latentserve.layers.linear import Linear
from latentserve.models.mla_attention import DeepseekAttention, scale_queries


class QGateAttention(DeepseekAttention):
    native_block = False  # the one-call decode block has no gate

    def __init__(self, config, *args, **kwargs) -> None:
        c = config
        if c.q_lora_rank is None:
            raise ValueError("config.json: field 'q_lora_rank' must be set: the fused query and gate projection "
                             "reads q's LoRA")
        super().__init__(config, *args, **kwargs)
        self.v_head_dim = c.v_head_dim
        self.q_b_proj = Linear(2 * c.q_lora_rank, c.num_attention_heads * (c.qk_head_dim + c.v_head_dim), bias=False)

    def forward(self, cos: torch.Tensor, sin: torch.Tensor, hidden: torch.Tensor,
                q_scale: torch.Tensor | None = None) -> torch.Tensor:
        q_a = self.q_a_proj(hidden)
        q_resid = self.q_a_layernorm(q_a)
        fused = self.q_b_proj(torch.cat([q_resid, q_a], dim=-1)).view(hidden.shape[0], self.num_heads, -1)
        q, gate = fused.split([fused.shape[-1] - self.v_head_dim, self.v_head_dim], dim=-1)
        out = self.attend(cos, sin, hidden, scale_queries(q.contiguous(), q_scale), q_resid)
        return self.o_proj((out * torch.sigmoid(gate.flatten(1).float())).to(out.dtype))


class HiddenGateAttention(DeepseekAttention):
    native_block = False  # the one-call decode block has no gate

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self.gate_proj = Linear(config.hidden_size, config.num_attention_heads * config.v_head_dim, bias=False)

    def forward(self, cos: torch.Tensor, sin: torch.Tensor, hidden: torch.Tensor,
                q_scale: torch.Tensor | None = None) -> torch.Tensor:
        q, q_resid = self.project_q(hidden)
        out = self.attend(cos, sin, hidden, scale_queries(q, q_scale), q_resid)
        return self.o_proj(out * torch.sigmoid(self.gate_proj(hidden)))


class HeadGateAttention(DeepseekAttention):
    native_block = False  # the one-call decode block has no gate

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self.g_proj = Linear(config.hidden_size, config.num_attention_heads, bias=False)

    def forward(self, cos: torch.Tensor, sin: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        out = self.attend(cos, sin, hidden, *self.project_q(hidden))
        gate = torch.sigmoid(self.g_proj(hidden).float()).to(out.dtype)
        return self.o_proj((out.view(*gate.shape, -1) * gate[..., None]).flatten(1))
