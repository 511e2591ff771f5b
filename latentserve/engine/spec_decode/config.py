"""`SpeculativeConfig`: `LLM(..., speculative_config={"method": "mtp", "num_speculative_tokens": k})`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("mtp",)
# Above this many requests in a step, drafting is off by default. On the embedded model (benchmarks/speculative.py,
# benchmarks/RESULTS.md "MTP speculative decoding", 2026-12-04, after the one-thread native linears made plain
# decode 1.8x faster) decode with k = 1 is 1.10x at 1 request and 1.22x at 2, but 0.76-0.78x at 3-4: verifying 6+
# tokens leaves latentserve's few-row kernels for the batched paths. A deeper model, whose MTP layer is a smaller
# share of a step, crosses later; `disable_by_batch_size` raises it.
DEFAULT_DISABLE_BY_BATCH_SIZE = 2


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "mtp"
    num_speculative_tokens: int = 1  # drafts per step; k > 1 chains the one MTP layer, as vLLM does
    # Steps with more requests than this neither draft nor run the MTP layer (its cache then misses their
    # positions, which costs later drafts some acceptance, never exactness). None: always draft.
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an int >= 1, got {k!r}")
        b = self.disable_by_batch_size
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(f"speculative_config: disable_by_batch_size must be an int >= 1 or None, got {b!r}")

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
            raise ValueError("speculative_config: 'method' is required (supported: 'mtp')")
        return cls(**value)
