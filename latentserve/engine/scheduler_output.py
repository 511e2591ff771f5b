"""What the scheduler hands the model runner for one step: the scheduled requests and the batch they form."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from latentserve.attention.metadata import CommonAttentionMetadata
from latentserve.engine.request import Request


@dataclass
class ScheduledRequest:
    """One request's part of a step: `num_new_tokens` tokens after `num_computed_tokens` cached ones."""

    request: Request
    num_computed_tokens: int
    num_new_tokens: int
    token_ids: list[int]  # the tokens fed this step
    slot_mapping: list[int]  # KV cache slot of each new token
    block_ids: list[int]  # the block table for this step
    do_sample: bool  # False for a prefill chunk that leaves part of the prompt for later
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify: the last num_drafts tokens fed
    state_slot: int | None = None  # hybrid models: the request's linear-attention state slot (engine/state_pool.py)

    @property
    def num_drafts(self) -> int:
        return len(self.spec_token_ids)

    @property
    def seq_len(self) -> int:
        return self.num_computed_tokens + self.num_new_tokens

    @property
    def positions(self) -> range:
        return range(self.num_computed_tokens, self.seq_len)


@dataclass
class SchedulerOutput:
    """One step's batch, decodes first; everything the model runner needs to run it."""

    scheduled: list[ScheduledRequest]
    num_decodes: int
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # ended while scheduling (could never fit)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def query_lens(self) -> list[int]:
        return [s.num_new_tokens for s in self.scheduled]

    @property
    def seq_lens(self) -> list[int]:
        return [s.seq_len for s in self.scheduled]

    @property
    def input_ids(self) -> list[int]:
        return [t for s in self.scheduled for t in s.token_ids]

    @property
    def positions(self) -> list[int]:
        return [p for s in self.scheduled for p in s.positions]

    @property
    def slot_mapping(self) -> list[int]:
        return [slot for s in self.scheduled for slot in s.slot_mapping]

    @property
    def sampling_requests(self) -> list[Request]:
        """Requests that sample a token this step, in the order of `logits_indices`."""
        return [s.request for s in self.scheduled if s.do_sample]

    @property
    def logits_indices(self) -> list[int]:
        """Flat index of the last new token of each sampling request."""
        indices, end = [], 0
        for s in self.scheduled:
            end += s.num_new_tokens
            if s.do_sample:
                indices.append(end - 1)
        return indices

    def block_table_tensor(self) -> torch.Tensor:
        """[num_reqs, max_blocks] int32, padded with block 0 (never read past seq_len)."""
        width = max((len(s.block_ids) for s in self.scheduled), default=0)
        table = torch.zeros(len(self.scheduled), width, dtype=torch.int32)
        for i, s in enumerate(self.scheduled):
            table[i, : len(s.block_ids)] = torch.tensor(s.block_ids, dtype=torch.int32)
        return table

    def common_attention_metadata(self, device: torch.device | str = "cpu") -> CommonAttentionMetadata:
        return CommonAttentionMetadata.from_lists(
            self.query_lens,
            self.seq_lens,
            self.block_table_tensor(),
            torch.tensor(self.slot_mapping, dtype=torch.int64),
            device=device,
        )
