"""What the engine hands back to the user for each request (vLLM's shapes)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from latentserve.engine.parallel_sampling import SampleGroup
from latentserve.engine.request import Logprobs, Request


@dataclass
class Logprob:
    """vLLM's: a token's logprob at one position, its rank there (1: the likeliest) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None  # None when the engine has no tokenizer or the request has detokenize=False


LogprobsOnePosition = dict[int, Logprob]  # token id -> Logprob: the chosen token first, then the top-k by rank


@dataclass
class CompletionOutput:
    """One completion of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # None unless logprobs were asked for
    logprobs: list[LogprobsOnePosition] | None
    finish_reason: str | None = None  # "stop", "length", "abort", "error"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string, when one ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state so far: its prompt and its completions (n of them, or best_of's n best)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[LogprobsOnePosition | None] | None  # None at the first position: nothing predicts it
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # why a request finished with finish_reason "error"

    @classmethod
    def from_request(cls, request: Request) -> "RequestOutput":
        return cls._build(request, [_completion(request, 0, request.logprobs is not None)], request.is_finished,
                          request.error)

    @classmethod
    def from_group(cls, group: SampleGroup) -> "RequestOutput":
        """One output for the samples of an n / best_of request: with best_of > n, the n of highest
        cumulative logprob (best first, indexed 0..n-1)."""
        params = group.params
        # Without logprobs asked for, the samples track them for the ranking only.
        completions = [_completion(s, i, params.logprobs is not None) for i, s in enumerate(group.samples)]
        if params.num_samples > params.n:
            completions = sorted(completions, key=lambda c: c.cumulative_logprob, reverse=True)[: params.n]
            for index, completion in enumerate(completions):
                completion.index = index
        error = next((s.error for s in group.samples if s.error is not None), None)
        return cls._build(group.leader, completions, group.finished, error)

    @classmethod
    def _build(cls, leader: Request, completions: list[CompletionOutput], finished: bool,
               error: str | None) -> "RequestOutput":
        return cls(
            request_id=leader.request_id,
            prompt=leader.prompt,
            prompt_token_ids=list(leader.prompt_token_ids),
            prompt_logprobs=(_converted(leader.prompt_logprobs, leader.built_prompt_logprobs, _token_text(leader))
                             if leader.prompt_logprobs is not None else None),
            outputs=completions,
            finished=finished,
            num_cached_tokens=max(leader.num_cached_tokens, 0),
            error=error,
        )


def _logprob_dict(entry: Logprobs, token_text: Callable[[int], str] | None) -> LogprobsOnePosition:
    """vLLM's dict of one position: the chosen token with its rank, then the top-k ranked 1..k (a chosen token among
    them takes its place there, as in vLLM)."""
    def logprob(token_id: int, value: float, rank: int) -> Logprob:
        return Logprob(value, rank, token_text(token_id) if token_text is not None else None)

    result = {entry.token_id: logprob(entry.token_id, entry.logprob, entry.rank)}
    for rank, (token_id, value) in enumerate(entry.top, 1):
        result[token_id] = logprob(token_id, value, rank)
    return result


def _converted(entries: list[Logprobs | None], built: list[LogprobsOnePosition | None],
               token_text: Callable[[int], str] | None) -> list[LogprobsOnePosition | None]:
    """`entries` as Logprob dicts. A request's output is rebuilt every step: `built` keeps the positions converted
    (and their tokens decoded) for earlier outputs, so each position is converted once."""
    built.extend(None if entry is None else _logprob_dict(entry, token_text) for entry in entries[len(built):])
    return list(built)


def _token_text(request: Request) -> Callable[[int], str] | None:
    return request.detokenizer.token_text if request.detokenizer is not None else None


def _completion(request: Request, index: int, with_logprobs: bool) -> CompletionOutput:
    detok = request.detokenizer
    return CompletionOutput(
        index=index,
        text=detok.get_output_text(request.is_finished) if detok is not None else "",
        token_ids=list(request.output_token_ids),
        cumulative_logprob=request.cumulative_logprob if request.logprobs is not None else None,
        logprobs=(_converted(request.logprobs, request.built_logprobs, _token_text(request))
                  if with_logprobs and request.logprobs is not None else None),
        finish_reason=request.finish_reason,
        stop_reason=request.stop_reason,
    )


def request_outputs(requests: list[Request]) -> list[RequestOutput]:
    """The outputs for requests a step updated: one per plain request, one per n / best_of group."""
    outputs, seen = [], set()
    for request in requests:
        group = request.group
        if group is None:
            outputs.append(RequestOutput.from_request(request))
        elif id(group) not in seen:
            seen.add(id(group))
            if group.reports_partial or group.finished:
                outputs.append(RequestOutput.from_group(group))
    return outputs
