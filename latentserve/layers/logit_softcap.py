"""Logit soft-capping (Mistral Large 4's `final_logit_softcapping`): logits squashed smoothly into (-cap, cap) by
cap * tanh(logits / cap), so no token's logit runs away while small logits stay almost as they are."""
from __future__ import annotations

import torch


def check_softcap(cap: float | None) -> float | None:
    """The cap as a config gives it (None: no capping); a cap that is not a positive number is refused."""
    if cap is not None and not (isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap > 0):
        raise ValueError(f"final_logit_softcapping must be a positive number or None, got {cap!r}")
    return cap


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """logits `[T, V]` capped at `cap` (None: as they are)."""
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap
