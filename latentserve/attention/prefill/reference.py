"""REFERENCE: explicit fp32 softmax attention, the oracle the fast backends are held to."""
from __future__ import annotations

import torch

from latentserve.attention.prefill.varlen import VarlenPrefillBackend


class ReferencePrefillBackend(VarlenPrefillBackend):
    @classmethod
    def get_name(cls) -> str:
        return "REFERENCE"

    def _attend(self, q, k, v, causal):
        scores = torch.einsum("qnd,knd->nqk", q.float(), k.float()) * self.scale
        if causal:
            n, m = q.shape[0], k.shape[0]
            # Query i sits at position m - n + i among the keys.
            future = torch.ones(n, m, dtype=torch.bool, device=q.device).triu(m - n + 1)
            scores = scores.masked_fill(future, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.einsum("nqk,knv->qnv", torch.softmax(scores, dim=-1), v.float())
        return out.to(q.dtype), lse.transpose(0, 1)
