"""What a drafter is given of each scheduled request after a step, and the drafters' common face."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from latentserve.attention.metadata import CommonAttentionMetadata
from latentserve.engine.scheduler_output import ScheduledRequest


@dataclass
class Proposal:
    """One scheduled request's part of a step, for drafting its next one."""

    scheduled: ScheduledRequest
    start: int  # its first row in the step's batch
    emitted: list[int]  # the tokens it emitted this step (accepted drafts, then the sampled one); [] if none
    kept: int  # its rows whose tokens stand: all but those of rejected drafts
    num_drafts: int  # drafts wanted for its next step (0: none)

    @property
    def end(self) -> int:
        """The position after its last kept row."""
        return self.scheduled.num_computed_tokens + self.kept

    def history(self) -> list[int]:
        """Its tokens so far, this step's emitted ones included (the scheduler appends those after the step)."""
        return self.scheduled.request.all_token_ids + self.emitted


class Proposer(Protocol):
    k: int  # drafts per step at most

    def propose(self, proposals: list[Proposal], input_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor, common: CommonAttentionMetadata) -> list[list[int]]:
        """Each proposal's drafts (at most its num_drafts), from the main step's inputs and output hidden states."""
        ...
