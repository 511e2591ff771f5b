"""`SpeculativeConfig`: `LLM(..., speculative_config={"method": "mtp", "num_speculative_tokens": k})`, or
`{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n}` (drafts from the request's own tokens)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

METHODS = ("mtp", "ngram")
NGRAM_DEFAULT = 5  # vLLM's prompt_lookup_min and _max when neither is given
AUTO = "auto"


@dataclass(frozen=True)
class DraftingPolicy:
    """Up to how many requests a step drafts (None: any number, 0: never), and why."""

    max_batch_size: int | None
    reason: str


def auto_policy(weight_bytes: int, device: str | torch.device, cache_bytes: int | None) -> DraftingPolicy:
    """`disable_by_batch_size="auto"`: draft where verifying k+1 tokens costs little more than decoding one.

    On a CPU that holds when a step streams its weights from memory (benchmarks/RESULTS.md, "2026-12-04 (evening):
    when MTP drafting pays"): a model that fits in the last-level cache (`cache_bytes`) is bound by arithmetic, so a
    verification step costs about k+1 decode steps and drafting loses at any acceptance (the embedded model: 0.84x
    at 87 %). Where weights stream, a routed-expert model still reads about twice the expert weights for two
    tokens (a verification step of a 24-layer V3-shaped model costs 1.5x a decode step at 1 request, 1.7-1.8x at
    2), so drafting pays at one request only, and by 1.1-1.2x at 85-90 % acceptance. A GPU verifies a few tokens
    for about the cost of one: drafting at every batch size, as vLLM's default."""
    if torch.device(device).type != "cpu":
        return DraftingPolicy(None, f"device {torch.device(device).type}: verification costs about one decode step")
    size = f"the weights ({weight_bytes / 2**20:.0f} MiB)"
    if cache_bytes is None:
        return DraftingPolicy(1, f"{size} against an unknown last-level cache: assumed streamed, drafting at one "
                                 "request")
    cache = f"the CPU's last-level cache ({cache_bytes / 2**20:.0f} MiB)"
    if weight_bytes <= cache_bytes:
        return DraftingPolicy(0, f"{size} fit in {cache}: a step is bound by arithmetic and verifying drafts costs "
                                 "what they save; drafting off (set disable_by_batch_size to force it)")
    return DraftingPolicy(1, f"{size} stream past {cache}: drafting at one request, where verification costs "
                             "least")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "mtp"
    num_speculative_tokens: int = 1  # drafts per step; k > 1 chains the one MTP layer, as vLLM does
    # Steps with more requests than this neither draft nor run the MTP layer (its cache then misses their
    # positions, which costs later drafts some acceptance, never exactness). None: always draft; "auto": by where
    # drafting pays on this device and model (`auto_policy`).
    disable_by_batch_size: int | None | str = AUTO
    # ngram: the lengths of the token runs looked up (one given: both; neither: 5 and 5, as vLLM)
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {METHODS}, got {self.method!r}")
        self._check_lookup()
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an int >= 1, got {k!r}")
        b = self.disable_by_batch_size
        if b is not None and b != AUTO and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(f"speculative_config: disable_by_batch_size must be an int >= 1, None or 'auto', "
                             f"got {b!r}")

    def _check_lookup(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if self.method != "ngram":
            if lo is not None or hi is not None:
                raise ValueError("speculative_config: prompt_lookup_min / prompt_lookup_max apply to method 'ngram' "
                                 f"only, not {self.method!r}")
            return
        lo, hi = (lo if lo is not None else hi), (hi if hi is not None else lo)
        lo, hi = (NGRAM_DEFAULT, NGRAM_DEFAULT) if lo is None else (lo, hi)
        for name, n in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"speculative_config: {name} must be an int >= 1, got {n!r}")
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min={lo} exceeds prompt_lookup_max={hi}")
        object.__setattr__(self, "prompt_lookup_min", lo)  # frozen: the resolved values, set once
        object.__setattr__(self, "prompt_lookup_max", hi)

    def drafting_policy(self, weight_bytes: int, device: str | torch.device,
                        cache_bytes: int | None) -> DraftingPolicy:
        b = self.disable_by_batch_size
        if b == AUTO:
            return auto_policy(weight_bytes, device, cache_bytes)
        return DraftingPolicy(b, "set by disable_by_batch_size" if b is not None else "drafting at every batch size")

    @classmethod
    def from_value(cls, value: "SpeculativeConfig | dict[str, Any] | None") -> "SpeculativeConfig | None":
        """None, a SpeculativeConfig, or vLLM's dict form; unknown keys are refused by name."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a dict like {'method': 'mtp', 'num_speculative_tokens': 1}, "
                             f"got {type(value).__name__}")
        unknown = sorted(set(value) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; supported: "
                             f"{sorted(cls.__dataclass_fields__)}")
        if "method" not in value:
            raise ValueError(f"speculative_config: 'method' is required (supported: {', '.join(METHODS)})")
        return cls(**value)
