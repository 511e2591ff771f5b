"""How to sample one request: the user's knobs, validated up front (vLLM's names, defaults and rules)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from latentserve.structured_params import StructuredOutputsParams

# Temperatures below this are treated as greedy (dividing by them would overflow).
_GREEDY_EPS = 1e-5
# vLLM clamps each logit bias to this range (OpenAI documents -100..100).
_MAX_LOGIT_BIAS = 100.0


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_float(name: str, value: object, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be in {bracket}{low}, {high}], got {value}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def _token_ids(name: str, values: object) -> list[int]:
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__iter__"):
        raise ValueError(f"{name} must be a list of token ids, got {values!r}")
    values = list(values)
    for token_id in values:
        _check_int(f"each {name} entry", token_id, 0)
    return values


@dataclass
class SamplingParams:
    """Sampling settings of one request (vLLM's names and defaults)."""

    n: int = 1  # completions returned
    best_of: int | None = None  # completions generated (>= n); the n with the highest cumulative logprob are returned
    presence_penalty: float = 0.0  # subtracted once from each token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt and output tokens
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None  # words whose last token is banned when the output ends with the rest
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: as many as max_model_len allows
    min_tokens: int = 0  # EOS and stop_token_ids are banned until this many tokens are out
    logprobs: int | None = None  # top-k logprobs per generated token (plus the chosen one); -1: the whole vocabulary
    prompt_logprobs: int | None = None  # same, per prompt token
    detokenize: bool = True  # False: no output text (token ids only), which saves decoding each token
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None  # keep only the last k prompt tokens; -1: the last max_model_len
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, clamped to [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    structured_outputs: StructuredOutputsParams | None = None  # the output must match a schema, regex, choice, grammar

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1)
        if self.best_of is not None:
            _check_int("best_of", self.best_of, 1)
            if self.best_of < self.n:
                raise ValueError(f"best_of must be >= n, got n={self.n} and best_of={self.best_of}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, -1)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, math.inf, low_open=True)
        if self.seed is not None:
            _check_int("seed", self.seed, 0)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        self.stop = self._normalize_stop(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else _token_ids("stop_token_ids", self.stop_token_ids)
        self.bad_words = self._normalize_bad_words(self.bad_words)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), -1)  # -1: the whole vocabulary (vLLM's)
        for name in ("include_stop_str_in_output", "ignore_eos", "detokenize", "skip_special_tokens",
                     "spaces_between_special_tokens"):
            _check_bool(name, getattr(self, name))
        if self.stop and not self.detokenize:
            # Stop strings are found in the output text, which detokenize=False never builds.
            raise ValueError(f"stop strings {self.stop!r} need detokenize=True (stop_token_ids work without it)")
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, -1)
            if self.truncate_prompt_tokens == 0:
                raise ValueError("truncate_prompt_tokens must be >= 1 or -1, got 0")
        self.logit_bias = self._normalize_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (nothing could be sampled)")
        self._check_structured_outputs()

    def _check_structured_outputs(self) -> None:
        if self.structured_outputs is None:
            return
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {self.structured_outputs!r}")
        if self.min_tokens > 0:
            # The grammar decides where the output ends: banning the end until min_tokens could leave no token.
            raise ValueError("min_tokens cannot be combined with structured_outputs")

    @staticmethod
    def _normalize_stop(stop: str | list[str] | None) -> list[str]:
        if stop is None:
            return []
        stops = [stop] if isinstance(stop, str) else list(stop)
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"each stop string must be a non-empty str, got {s!r}")
        return stops

    @staticmethod
    def _normalize_bad_words(bad_words: str | list[str] | None) -> list[str]:
        if bad_words is None:
            return []
        words = [bad_words] if isinstance(bad_words, str) else list(bad_words)
        for word in words:
            if not isinstance(word, str) or not word.strip():
                raise ValueError(f"each bad_words entry must be a non-blank str, got {word!r}")
        return words

    @staticmethod
    def _normalize_logit_bias(logit_bias: dict | None) -> dict[int, float] | None:
        if logit_bias is None:
            return None
        if not isinstance(logit_bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(logit_bias).__name__}")
        result = {}
        for token, bias in logit_bias.items():
            # JSON object keys are strings: accept "123" as token 123, as vLLM does.
            token_id = int(token) if isinstance(token, str) and token.strip().lstrip("-").isdigit() else token
            _check_int("each logit_bias token id", token_id, 0)
            _check_float(f"logit_bias[{token_id}]", bias, -math.inf, math.inf)
            result[token_id] = min(_MAX_LOGIT_BIAS, max(-_MAX_LOGIT_BIAS, float(bias)))
        return result

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Token ids must exist in the model's vocabulary; a ValueError names the field that has one that does not."""
        fields = {
            "stop_token_ids": self.stop_token_ids,
            "logit_bias": list(self.logit_bias or ()),
            "allowed_token_ids": self.allowed_token_ids or [],
        }
        for name, token_ids in fields.items():
            bad = [t for t in token_ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} has token ids {bad[:5]} outside the vocabulary (size {vocab_size})")

    @property
    def num_samples(self) -> int:
        """Completions generated: best_of if set, else n."""
        return self.best_of if self.best_of is not None else self.n

    def for_sample(self, index: int) -> "SamplingParams":
        """The params of one of the request's parallel samples: one completion, its own seed (seed + index).

        Only the first sample scores the prompt; under best_of > n every sample tracks its logprob, for ranking.
        """
        seed = None if self.seed is None else self.seed + index
        logprobs = self.logprobs
        if logprobs is None and self.num_samples > self.n:
            logprobs = 0
        prompt_logprobs = self.prompt_logprobs if index == 0 else None
        return replace(self, n=1, best_of=None, seed=seed, logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
