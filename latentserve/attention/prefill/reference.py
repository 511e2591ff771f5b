"""REFERENCE: explicit fp32 softmax attention, the oracle the fast backends are held to."""
from __future__ import annotations

import torch

from latentserve.attention.prefill.varlen import VarlenPrefillBackend, hidden_keys


class ReferencePrefillBackend(VarlenPrefillBackend):
    supports_sliding_window = True

    @classmethod
    def get_name(cls) -> str:
        return "REFERENCE"

    def _attend(self, q, k, v, causal, distance):
        scores = torch.einsum("qnd,knd->nqk", q.float(), k.float()) * self.scale
        hidden = hidden_keys(q.shape[0], k.shape[0], distance, causal, self.sliding_window, q.device)
        scores = scores.masked_fill(hidden, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        # A query whose window misses every key of a context chunk: output 0 and lse -inf (merge ignores it).
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        out = torch.einsum("nqk,knv->qnv", probs, v.float())
        return out.to(q.dtype), lse.transpose(0, 1)
