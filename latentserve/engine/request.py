"""The state of one request as it moves through the scheduler."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from latentserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from latentserve.engine.detokenizer import IncrementalDetokenizer
    from latentserve.engine.parallel_sampling import SampleGroup
    from latentserve.engine.structured import StructuredOutputRequest


class RequestStatus(enum.IntEnum):
    """Where a request is; every status after PREEMPTED is final."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # could never run, e.g. needs more KV blocks than the pool holds

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}

@dataclass
class Logprobs:
    """One position's logprobs as the sampler computes them; outputs.py turns them into vLLM's Logprob dicts."""

    token_id: int  # the sampled token, or the prompt token the position predicts
    logprob: float
    rank: int  # vocabulary entries at least as likely as the token, itself included (1: the argmax)
    top: list[tuple[int, float]]  # the k likeliest (token id, logprob), likeliest first; k = -1: the whole vocabulary


class Request:
    """One prompt and its generated tokens, with its KV blocks and sampling state."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        prompt: str | None = None,
        detokenizer: IncrementalDetokenizer | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt has no tokens")
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.detokenizer = detokenizer
        self.arrival_time = time.monotonic()

        # Prompt then output tokens; what a recompute after preemption feeds the model.
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until scheduled
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        self.error: str | None = None

        self.bad_words_token_ids: list[list[int]] = []  # the tokenized bad_words (set by the engine)
        self.group: SampleGroup | None = None  # the samples of an n / best_of request this one belongs to
        self.structured_output: StructuredOutputRequest | None = None  # its grammar state (set by the engine)
        self.spec_token_ids: list[int] = []  # draft tokens to verify in the next step (speculative decoding)

        self.block_ids: list[int] = []  # the block table
        self.state_slot: int | None = None  # hybrid models: its linear-attention state (engine/state_pool.py)
        self.block_hashes: list[int] = []  # hash chain of the full blocks, filled lazily

        self.logprobs: list[Logprobs] | None = [] if sampling_params.logprobs is not None else None
        # The first prompt token has no logprob: nothing precedes it.
        self.prompt_logprobs: list[Logprobs | None] | None = (
            [None] if sampling_params.prompt_logprobs is not None else None
        )
        self.cumulative_logprob = 0.0
        # The positions of logprobs and prompt_logprobs outputs.py has turned into vLLM's Logprob dicts so far.
        self.built_logprobs: list[dict] = []
        self.built_prompt_logprobs: list[dict | None] = []
        self._generator: torch.Generator | None = None
        self._prompt_tensor: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self.status)

    def generator(self, device: torch.device | str) -> torch.Generator | None:
        """The request's own random stream when seeded (created on first use on `device`)."""
        seed = self.sampling_params.seed
        if seed is None:
            return None
        if self._generator is None:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(seed)
        return self._generator

    def prompt_token_ids_tensor(self) -> torch.Tensor:
        """The prompt as a CPU int64 tensor, built once (the penalties read it every step)."""
        if self._prompt_tensor is None:
            self._prompt_tensor = torch.tensor(self.prompt_token_ids, dtype=torch.long)
        return self._prompt_tensor

    def banned_token_ids(self) -> list[int]:
        """Tokens that may not be sampled yet: the stop tokens, until min_tokens are out."""
        params = self.sampling_params
        if self.num_output_tokens >= params.min_tokens:
            return []
        eos = [] if params.ignore_eos or self.eos_token_id is None else [self.eos_token_id]
        return eos + list(params.stop_token_ids)

    def append_output_token(self, token_id: int, logprobs: Logprobs | None = None) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.logprobs is not None:
            if logprobs is None or logprobs.token_id != token_id:
                raise ValueError(f"request {self.request_id!r} asked for logprobs: the sampled token's logprob is missing")
            self.logprobs.append(logprobs)
            self.cumulative_logprob += logprobs.logprob

    def append_prompt_logprobs(self, first_position: int, entries: list[Logprobs]) -> None:
        """Record prompt logprobs for positions first_position.. (positions already known are kept)."""
        if self.prompt_logprobs is None:
            return
        skip = len(self.prompt_logprobs) - first_position
        if skip < 0:
            raise ValueError(f"request {self.request_id!r}: prompt logprobs at position {first_position} leave a gap")
        room = self.num_prompt_tokens - len(self.prompt_logprobs)
        self.prompt_logprobs.extend(entries[skip:][:room])

    def prompt_logprob_targets(self, start: int, num_tokens: int) -> list[int]:
        """The prompt tokens predicted by positions start..start+num_tokens-1 (one position ahead)."""
        return self.prompt_token_ids[start + 1 : min(start + num_tokens + 1, self.num_prompt_tokens)]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
