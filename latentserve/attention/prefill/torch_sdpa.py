"""TORCH_SDPA: PyTorch's fused flash attention, which also returns the log-sum-exp."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from latentserve.attention.backend import SelectorConfig
from latentserve.attention.prefill.varlen import VarlenPrefillBackend, hidden_keys


@functools.cache
def cpu_flash_takes(dtype: torch.dtype) -> bool:
    """Whether PyTorch's CPU flash kernel runs `dtype` on this CPU. With ATen's AVX2 kernels on a CPU with AMX
    (`ATEN_CPU_CAPABILITY=avx2`), torch 2.13 packs bf16 blocks of 64 queries and keys or more for AMX, which only its
    AVX-512 kernels can, and raises "pack_vnni2 is only supported when avx512 is supported": tried once, on blocks
    that take that path."""
    x = torch.zeros(1, 1, 256, 64, dtype=dtype)
    try:
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(x, x, x, 0.0, False)
    except RuntimeError:
        return False
    return True


def _flash_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                    hidden: torch.Tensor | None = None):
    """q, k, v `[1, N, S, D]` with one head dim -> out `[1, N, Sq, D]`, lse `[1, N, Sq]`; `hidden` `[Sq, Sk]`: keys
    masked out (CPU only). A dtype the CPU kernel refuses here (`cpu_flash_takes`) runs in fp32, out in its dtype."""
    if q.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        return out, lse
    if not cpu_flash_takes(q.dtype):
        out, lse = _flash_with_lse(q.float(), k.float(), v.float(), causal, scale, hidden)
        return out.to(q.dtype), lse
    if hidden is None:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    bias = torch.zeros(hidden.shape, dtype=q.dtype, device=q.device).masked_fill_(hidden, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias,
                                                                            scale=scale)
    # The kernel gives a query that sees no key output 0 but lse 0; the merge needs -inf there.
    return out, lse.masked_fill(hidden.all(-1), float("-inf"))


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
    supports_sliding_window = True

    @classmethod
    def validate_configuration(cls, device: torch.device | str, selector_config: SelectorConfig) -> list[str]:
        reasons = super().validate_configuration(device, selector_config)
        if selector_config.sliding_window is not None and torch.device(device).type != "cpu":
            reasons.append("TORCH_SDPA masks a sliding window on the CPU only (the CUDA flash kernel takes no mask)")
        c = selector_config
        if c.v_head_dim > c.qk_nope_head_dim + c.qk_rope_head_dim:
            # The kernel takes one head dim: v is widened to q's, never q narrowed to v's.
            reasons.append(f"TORCH_SDPA needs v_head_dim ({c.v_head_dim}) <= the query head dim "
                           f"({c.qk_nope_head_dim + c.qk_rope_head_dim})")
        return reasons

    @classmethod
    def get_name(cls) -> str:
        return "TORCH_SDPA"

    def _attend(self, q, k, v, causal, distance):
        if causal and q.shape[0] != k.shape[0]:
            raise ValueError(f"causal prefill needs as many keys as queries, got {q.shape[0]} and {k.shape[0]}")
        width = v.shape[-1]
        v, first = _widen(v, q.shape[-1])
        qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        hidden = None
        if self.sliding_window is not None:
            hidden = hidden_keys(q.shape[0], k.shape[0], distance, causal, self.sliding_window, q.device)
        out, lse = _flash_with_lse(qh, kh, vh, causal, self.scale, hidden)
        return out[0].transpose(0, 1)[..., first:first + width], lse[0].transpose(0, 1).float()
