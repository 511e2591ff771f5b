"""Combine two partial attention results over disjoint key sets by their log-sum-exp."""
from __future__ import annotations

import torch


def merge_attn_states(
    prefix_output: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge `[T, N, V]` outputs with `[T, N]` lse into the attention over both key sets.

    A `+inf` lse counts as `-inf` (no keys). When both sides have no keys the result is the
    prefix output with lse `-inf`, never NaN.
    """
    neg_inf = torch.tensor(float("-inf"), dtype=torch.float32, device=prefix_lse.device)
    a = torch.where(prefix_lse == float("inf"), neg_inf, prefix_lse.float())
    b = torch.where(suffix_lse == float("inf"), neg_inf, suffix_lse.float())
    m = torch.maximum(a, b)
    both_empty = m == float("-inf")
    m = torch.where(both_empty, torch.zeros_like(m), m)
    ea = torch.exp(a - m)
    eb = torch.exp(b - m)
    total = ea + eb
    safe_total = torch.where(both_empty, torch.ones_like(total), total)
    wa = torch.where(both_empty, torch.ones_like(ea), ea / safe_total)
    wb = torch.where(both_empty, torch.zeros_like(eb), eb / safe_total)
    out = wa.unsqueeze(-1) * prefix_output.float() + wb.unsqueeze(-1) * suffix_output.float()
    lse = torch.where(both_empty, neg_inf, m + torch.log(safe_total))
    return out.to(prefix_output.dtype), lse
