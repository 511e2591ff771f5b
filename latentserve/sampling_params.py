"""How to sample one request: the user's knobs, validated up front."""
from __future__ import annotations

import math
from dataclasses import dataclass

# Temperatures below this are treated as greedy (dividing by them would overflow).
_GREEDY_EPS = 1e-5


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


@dataclass
class SamplingParams:
    """Sampling settings of one request (vLLM's names and defaults)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    seed: int | None = None
    max_tokens: int | None = 16  # None: as many as max_model_len allows
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per generated token (plus the chosen one)
    prompt_logprobs: int | None = None  # same, per prompt token
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1)
        if self.n != 1:
            raise ValueError(f"n={self.n} is not supported: only one completion per request (n=1)")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, -1)
        if self.seed is not None:
            _check_int("seed", self.seed, 0)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        self.stop = self._normalize_stop(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        else:
            self.stop_token_ids = list(self.stop_token_ids)
            for token_id in self.stop_token_ids:
                _check_int("each stop_token_ids entry", token_id, 0)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0)

    @staticmethod
    def _normalize_stop(stop: str | list[str] | None) -> list[str]:
        if stop is None:
            return []
        stops = [stop] if isinstance(stop, str) else list(stop)
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"each stop string must be a non-empty str, got {s!r}")
        return stops

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0
