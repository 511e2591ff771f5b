"""Acceptance counters of speculative decoding (vLLM's spec-decode metrics)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    """Totals since the engine started; one draft = one request's drafts of one step."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_drafts_per_pos: list[int] = field(default_factory=list)  # drafts that reached each position

    def __post_init__(self) -> None:
        self.num_accepted_tokens_per_pos = self.num_accepted_tokens_per_pos or [0] * self.num_spec_tokens
        self.num_drafts_per_pos = self.num_drafts_per_pos or [0] * self.num_spec_tokens

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        if not 0 <= num_accepted_tokens <= num_draft_tokens <= self.num_spec_tokens:
            raise ValueError(f"{num_accepted_tokens} accepted of {num_draft_tokens} drafts (k={self.num_spec_tokens})")
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for pos in range(num_draft_tokens):
            self.num_drafts_per_pos[pos] += 1
        for pos in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[pos] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        """Of the drafts that reached a position, the share whose token there was accepted (all before it were)."""
        return [a / d if d else 0.0 for a, d in zip(self.num_accepted_tokens_per_pos, self.num_drafts_per_pos)]

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens each verifying step emits per request on average: the accepted drafts plus the one it samples."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
