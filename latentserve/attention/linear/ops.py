"""The math of Kimi Delta Attention (KDA) over one request's tokens, continuing from its state.

Both pieces carry a per-request state across steps instead of reading cached tokens back:

- the short causal convolution keeps the last `kernel_size - 1` inputs (`conv_state`);
- the gated delta rule keeps a `[H, K, V]` matrix per request (`recurrent_state`), updated token by token with a
  per-channel decay, computed in fp32 as the reference does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution (weight `[C, K]`) of B sequences x `[B, T, C]`, each continuing after its
    conv_state `[B, C, K-1]` (the previous inputs; zeros at a request's start), SiLU after it. Returns (out
    `[B, T, C]`, the new conv states `[B, C, K-1]`)."""
    full = torch.cat([conv_state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [B, C, K-1+T]
    windows = full.unfold(-1, weight.shape[-1], 1).to(weight.dtype)  # [B, C, T, K]: token t sees inputs t-K+1..t
    out = (windows * weight[:, None, :]).sum(-1)
    return F.silu(out).transpose(1, 2).to(x.dtype), full[..., full.shape[-1] - conv_state.shape[-1]:]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps): eps inside the root, as the reference kernels have it (not F.normalize's clamp)."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule of B sequences of T tokens: q, k, g `[B, T, H, K]`, v `[B, T, H, V]`, beta `[B, T, H]`,
    state `[B, H, K, V]` fp32. Per token: decay the state by exp(g) per key channel, correct what it recalls for k
    towards v by beta, read it with q. Returns (out `[B, T, H, V]` in q's dtype, the new state)."""
    dtype = q.dtype
    q, k = l2norm(q.float()), l2norm(k.float())
    q = q * q.shape[-1] ** -0.5
    v, decay, beta = v.float(), g.float().exp(), beta.float()
    out = torch.empty_like(v)
    for t in range(q.shape[1]):
        state = state * decay[:, t, :, :, None]
        recalled = (state * k[:, t, :, :, None]).sum(-2)  # [B, H, V]
        delta = (v[:, t] - recalled) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = (state * q[:, t, :, :, None]).sum(-2)
    return out.to(dtype), state
