"""Hyper-connections (Hunyuan V4): the residual stream is `n` streams per token, `[T, n, H]`.

Before a block (attention, MLP) a `HyperConnection` reads all streams and gives the block's input, a weighted sum of
the streams (`pre`), and per-stream weights for its output (`post`): streams <- streams + post * block(input). The
model's input is the embedding copied into every stream; `HyperHead` sums the streams into one before the final
norm. The weights come from the flattened streams through a small fp32 projection scaled by their inverse RMS, so
they depend on the token. Parameter names are the model's (`fn`, `base`, `scale`; `hc_fn`, `hc_base`, `hc_scale`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class HyperConnectionConfig:
    streams: int  # hc_mult
    magnitude: float  # scale of the post weights' sigmoid
    eps: float  # added to every sigmoid weight
    norm_eps: float  # of the inverse RMS
    # GLM-5 next's mHC (layers/mhc.py): the streams also mixed by a matrix this many Sinkhorn iterations make doubly
    # stochastic, and the output their plain mean. 0: Hunyuan V4's (no mixing, a learned head).
    sinkhorn_iters: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.streams, bool) or not isinstance(self.streams, int) or self.streams < 1:
            raise ValueError(f"config.json: field 'hc_mult' must be a positive int, got {self.streams!r}")
        iters = self.sinkhorn_iters
        if isinstance(iters, bool) or not isinstance(iters, int) or iters < 0:
            raise ValueError(f"config.json: field 'hc_sinkhorn_iters' must be a positive int, got {iters!r}")


def stream_mixes(flat: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """The streams' projection, scaled by their inverse RMS: `[T, n * H]` fp32 -> `[T, rows of fn]`."""
    return F.linear(flat, fn) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


class HyperConnection(nn.Module):
    def __init__(self, hidden_size: int, config: HyperConnectionConfig) -> None:
        super().__init__()
        n = config.streams
        self.config = config
        self.fn = nn.Parameter(torch.zeros(2 * n, n * hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros(2 * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.zeros(2, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """streams `[T, n, H]` -> (post weights `[T, n]` fp32, the block's input `[T, H]`)."""
        c = self.config
        pre_logits, post_logits = stream_mixes(streams.flatten(1).float(), self.fn, c.norm_eps).split(c.streams, dim=-1)
        pre_base, post_base = self.base.split(c.streams)
        pre = torch.sigmoid(pre_logits * self.scale[0] + pre_base) + c.eps
        post = c.magnitude * torch.sigmoid(post_logits * self.scale[1] + post_base) + c.eps
        return post, (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def add_to_streams(streams: torch.Tensor, post: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """streams + post * out, in fp32: `[T, n, H]`, `[T, n]`, `[T, H]`."""
    return (post.unsqueeze(-1) * out.float().unsqueeze(1) + streams.float()).to(streams.dtype)


class HyperHead(nn.Module):
    """The streams summed into one hidden state per token, by token-dependent weights."""

    def __init__(self, hidden_size: int, config: HyperConnectionConfig) -> None:
        super().__init__()
        n = config.streams
        self.config = config
        self.hc_fn = nn.Parameter(torch.zeros(n, n * hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.zeros(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        c = self.config
        mixes = stream_mixes(streams.flatten(1).float(), self.hc_fn, c.norm_eps)
        pre = torch.sigmoid(mixes * self.hc_scale + self.hc_base) + c.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
