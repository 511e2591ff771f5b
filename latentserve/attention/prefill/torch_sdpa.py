"""TORCH_SDPA: PyTorch's fused flash attention, which also returns the log-sum-exp."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from latentserve.attention.prefill.varlen import VarlenPrefillBackend


def _flash_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """q, k, v `[1, N, S, D]` with one head dim -> out `[1, N, Sq, D]`, lse `[1, N, Sq]`."""
    if q.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        return out, lse
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _widen(v: torch.Tensor, width: int) -> tuple[torch.Tensor, int]:
    """v `[..., V]` as `[..., width]` for a kernel that needs q's head dim, and where v's columns start in it.

    Output column j of attention reads only column j of v, so the added columns may hold anything: when memory
    lies to the left of v's rows (in MLA, the key columns of the same up-projected row) it is viewed, not copied.
    """
    pad = width - v.shape[-1]
    if pad == 0:
        return v, 0
    if v.stride(-1) == 1 and v.storage_offset() >= pad:
        return v.as_strided((*v.shape[:-1], width), v.stride(), v.storage_offset() - pad), pad
    return F.pad(v, (0, pad)), 0


class TorchSDPAPrefillBackend(VarlenPrefillBackend):

    @classmethod
    def get_name(cls) -> str:
        return "TORCH_SDPA"

    def _attend(self, q, k, v, causal):
        if causal and q.shape[0] != k.shape[0]:
            raise ValueError(f"causal prefill needs as many keys as queries, got {q.shape[0]} and {k.shape[0]}")
        v, first = _widen(v, q.shape[-1])
        qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        out, lse = _flash_with_lse(qh, kh, vh, causal, self.scale)
        return out[0].transpose(0, 1)[..., first:], lse[0].transpose(0, 1).float()
