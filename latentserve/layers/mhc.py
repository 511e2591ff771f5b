"""Manifold-constrained hyper-connections (mHC, GLM-5 next): hyper-connections whose residual streams are also
mixed with each other, by a doubly-stochastic matrix.

As in layers/hyper_connection.py the residual is `n` streams per token, `[T, n, H]`, and before each block an
`MHCConnection` gives the block's input (a weighted sum of the streams, `pre`) and the weights of its output per
stream (`post`). It also gives `comb` `[T, n, n]`: the streams after the block are `comb^T @ streams + post * out`.
`comb` is a softmax made doubly stochastic by Sinkhorn-Knopp iterations (rows and columns summing to 1), so mixing
keeps the streams' scale. The model's output is the streams' plain mean (`mean_of_streams`). Parameter names are the
model's (`fn`, `base`, `scale`).
"""
from __future__ import annotations

import torch
from torch import nn

from latentserve.layers.hyper_connection import HyperConnectionConfig, stream_mixes


class MHCConnection(nn.Module):
    def __init__(self, hidden_size: int, config: HyperConnectionConfig) -> None:
        super().__init__()
        n = config.streams
        self.config = config
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.zeros(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams `[T, n, H]` -> (post `[T, n]`, comb `[T, n, n]`, both fp32; the block's input `[T, H]`)."""
        c, n = self.config, self.config.streams
        mixes = stream_mixes(streams.flatten(1).float(), self.fn, c.norm_eps)
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + c.eps
        post = c.magnitude * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * self.scale[2] + comb_b.view(n, n), dim=-1) + c.eps
        return post, _sinkhorn(comb, c.sinkhorn_iters, c.eps), (pre.unsqueeze(-1) * streams).sum(dim=1).to(
            streams.dtype)


def _sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Columns, then (rows, columns) `iters - 1` times, normalized to sum to 1 (the model's order)."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def mix_streams(streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """comb^T @ streams + post * out, in the streams' dtype as the model computes it: `[T, n, H]`, `[T, n]`,
    `[T, n, n]`, `[T, H]`."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(1) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


def mean_of_streams(streams: torch.Tensor) -> torch.Tensor:
    return streams.mean(dim=1)
