"""One request's grammar state: its compiled grammar (maybe still compiling) and a matcher kept in step with the
request's output tokens."""
from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from latentserve.structured_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr


class StructuredOutputRequest:
    """The matcher consumes the output tokens after the reasoning (all of them without a reasoning parser).

    Its state is a function of the output tokens: `sync` accepts the new ones and rolls back those removed, so a
    preemption (which keeps the outputs and recomputes their KV) changes nothing and a rejected draft rolls back.
    """

    def __init__(self, params: StructuredOutputsParams, grammar: Future[xgr.CompiledGrammar],
                 reasoning_end_token_id: int | None = None) -> None:
        self.params = params
        self.grammar = grammar
        self.reasoning_end_token_id = reasoning_end_token_id
        self.matcher: xgr.GrammarMatcher | None = None
        self.start: int | None = 0 if reasoning_end_token_id is None else None  # first constrained output index
        self.num_scanned = 0  # output tokens searched for the end of the reasoning
        self.num_accepted = 0  # output tokens from `start` the matcher has accepted
        self.rejected_token: int | None = None

    @property
    def is_ready(self) -> bool:
        """The grammar compiled (or failed to: see `error`); the request may be scheduled."""
        return self.grammar.done()

    @property
    def error(self) -> str | None:
        if not self.grammar.done() or self.grammar.exception() is None:
            return None
        return f"structured_outputs.{self.params.kind}: the grammar failed to compile: {self.grammar.exception()}"

    def _get_matcher(self) -> xgr.GrammarMatcher:
        import xgrammar as xgr
        if self.matcher is None:
            self.matcher = xgr.GrammarMatcher(self.grammar.result())
        return self.matcher

    def sync(self, output_token_ids: list[int]) -> bool:
        """Bring the matcher to the output tokens; False if one of them breaks the grammar (it stays unaccepted)."""
        if self.start is None:
            self._find_reasoning_end(output_token_ids)
            if self.start is None:
                return True
        tokens = output_token_ids[self.start:]
        matcher = self._get_matcher()
        if len(tokens) < self.num_accepted:
            matcher.rollback(self.num_accepted - len(tokens))
            self.num_accepted = len(tokens)
        for token_id in tokens[self.num_accepted:]:
            if matcher.is_terminated() or not matcher.accept_token(token_id):
                self.rejected_token = token_id
                return False
            self.num_accepted += 1
        return True

    def _find_reasoning_end(self, output_token_ids: list[int]) -> None:
        tail = output_token_ids[self.num_scanned:]
        if self.reasoning_end_token_id in tail:
            self.start = self.num_scanned + tail.index(self.reasoning_end_token_id) + 1
        self.num_scanned = len(output_token_ids)

    @property
    def constrains_next(self) -> bool:
        """Whether the next token is constrained (false while the model is still reasoning)."""
        return self.start is not None

    @property
    def is_terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._get_matcher().fill_next_token_bitmask(bitmask, row)
