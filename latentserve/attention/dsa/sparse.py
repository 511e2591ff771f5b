"""Absorbed MLA attention over each token's selected cache positions only (DSA's sparse attention)."""
from __future__ import annotations

import torch

from latentserve.attention.kv_cache import gather_kv_cache


def sparse_mla_attention(q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, scale: float,
                         kv_lora_rank: int, workspace: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Absorbed queries `[T, N, L+R]` attend the cache rows at their `slots` `[T, K]` (-1: none) -> `[T, N, L]`.
    `sinks` `[N]`: a learned logit per head that joins each softmax's denominator and contributes no value.

    Keys are whole `[c_kv ‖ k_pe]` rows, values their first L values, as in the decode path; the work and the
    rows read are T * K whatever the context length. Rows are gathered into `workspace` a few tokens at a time.
    """
    num_tokens, k = slots.shape
    out = q.new_empty(num_tokens, q.shape[1], kv_lora_rank)
    step = max(1, workspace.shape[0] // k)
    for s in range(0, num_tokens, step):
        sel = slots[s : s + step]
        # Empty entries read a selected row of their token instead (masked below): a row nobody wrote may hold NaN,
        # and a zero weight times NaN is NaN.
        rows = gather_kv_cache(kv_cache, torch.where(sel < 0, sel.amax(dim=1, keepdim=True), sel).flatten(),
                               out=workspace)
        rows = rows.view(sel.shape[0], k, -1).float()
        scores = torch.einsum("tnd,tkd->tnk", q[s : s + step].float(), rows) * scale
        scores.masked_fill_((sel < 0)[:, None, :], float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks.float()[None, :, None].expand(scores.shape[0], -1, 1)], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., :k]
        out[s : s + step] = torch.einsum("tnk,tkl->tnl", probs, rows[..., :kv_lora_rank]).to(out.dtype)
    return out
