"""What the engine hands back to the user for each request (vLLM's shapes)."""
from __future__ import annotations

from dataclasses import dataclass

from latentserve.engine.request import Logprobs, Request


@dataclass
class CompletionOutput:
    """One completion of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # None unless logprobs were asked for
    logprobs: list[Logprobs] | None
    finish_reason: str | None = None  # "stop", "length", "abort", "error"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string, when one ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state so far: its prompt and its completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[Logprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # why a request finished with finish_reason "error"

    @classmethod
    def from_request(cls, request: Request) -> "RequestOutput":
        finished = request.is_finished
        detok = request.detokenizer
        completion = CompletionOutput(
            index=0,
            text=detok.get_output_text(finished) if detok is not None else "",
            token_ids=list(request.output_token_ids),
            cumulative_logprob=request.cumulative_logprob if request.logprobs is not None else None,
            logprobs=list(request.logprobs) if request.logprobs is not None else None,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
        )
        return cls(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            prompt_logprobs=list(request.prompt_logprobs) if request.prompt_logprobs is not None else None,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            error=request.error,
        )
