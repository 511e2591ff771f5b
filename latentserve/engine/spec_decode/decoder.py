"""`SpecDecoder`: one speculative step after the main model's forward — verify drafts, sample, propose the next.

The main model ran every scheduled token, drafts included (a decode with k+1 new tokens), and returned its hidden
states (after the final norm: the MTP layer reads them too). Requests with drafts are verified by rejection sampling
over their k+1 positions; the others sample their last position as without speculation. The proposer (the MTP layer
over the step's positions, or a lookup in each request's own tokens) then drafts each sampling request's next step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from latentserve.attention.metadata import CommonAttentionMetadata
from latentserve.engine.request import Logprobs, Request
from latentserve.engine.sampler import Sampler, SamplingMetadata
from latentserve.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from latentserve.engine.spec_decode.config import DraftingPolicy
from latentserve.engine.spec_decode.metrics import SpecDecodingStats
from latentserve.engine.spec_decode.proposal import Proposal, Proposer
from latentserve.engine.spec_decode.verifier import supports_speculation, verify
from latentserve.models.deepseek import DeepseekForCausalLM


@dataclass
class SpecStepOutput:
    sampled_token_ids: list[int]  # per sampling request: its last emitted token
    accepted_draft_ids: list[list[int]]  # per sampling request: the drafts it accepted, emitted before that token
    logprobs: list[Logprobs | None]
    spec_token_ids: dict[str, list[int]]  # request id -> drafts for the next step


class SpecDecoder:
    def __init__(
        self, model: DeepseekForCausalLM, proposer: Proposer, max_model_len: int,
        policy: DraftingPolicy,
    ) -> None:
        self.model = model
        self.proposer = proposer
        self.policy = policy
        self.k = proposer.k
        self.max_model_len = max_model_len
        self.sampler = Sampler()
        self.stats = SpecDecodingStats(self.k)

    def speculates(self, out: SchedulerOutput) -> bool:
        """Whether the step verifies drafts or proposes some; other steps sample as without speculation."""
        return self._drafts_for(out) or any(s.num_drafts for s in out.scheduled)

    def _drafts_for(self, out: SchedulerOutput) -> bool:
        limit = self.policy.max_batch_size
        return limit is None or len(out.scheduled) <= limit

    def step(
        self, out: SchedulerOutput, hidden: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
        common: CommonAttentionMetadata,
    ) -> SpecStepOutput:
        """The main step's output hidden states `[num tokens, hidden]`, its inputs and attention metadata."""
        starts, offset = [], 0
        for s in out.scheduled:
            starts.append(offset)
            offset += s.num_new_tokens
        sampling = [(s, start) for s, start in zip(out.scheduled, starts) if s.do_sample]
        plain = [(s, start) for s, start in sampling if not s.num_drafts]
        spec = [(s, start) for s, start in sampling if s.num_drafts]
        emitted: dict[int, list[int]] = {}
        logprobs: dict[int, Logprobs | None] = {}
        if plain:
            rows = torch.tensor([start + s.num_new_tokens - 1 for s, start in plain], device=hidden.device)
            logits = self.model.compute_logits(hidden[rows])
            requests = [s.request for s, _ in plain]
            sampled = self.sampler(logits, SamplingMetadata.from_requests(requests, logits.shape[-1], hidden.device))
            for (s, _), token, entry in zip(plain, sampled.sampled_token_ids, sampled.logprobs):
                emitted[id(s)], logprobs[id(s)] = [token], entry
        if spec:
            first = [start + s.num_new_tokens - s.num_drafts - 1 for s, start in spec]
            rows = torch.cat([torch.arange(f, f + s.num_drafts + 1) for (s, _), f in zip(spec, first)])
            logits = self.model.compute_logits(hidden[rows.to(hidden.device)])
            tokens = verify(logits, [s.request for s, _ in spec], [s.spec_token_ids for s, _ in spec], self.k)
            for (s, _), row in zip(spec, tokens):
                emitted[id(s)], logprobs[id(s)] = row, None
                self.stats.observe_draft(s.num_drafts, len(row) - 1)
        drafts: list[list[int]] = []
        if self._drafts_for(out):
            drafts = self._propose(out.scheduled, starts, emitted, hidden, input_ids, positions, common)
        return SpecStepOutput(
            sampled_token_ids=[emitted[id(s)][-1] for s, _ in sampling],
            accepted_draft_ids=[emitted[id(s)][:-1] for s, _ in sampling],
            logprobs=[logprobs[id(s)] for s, _ in sampling],
            spec_token_ids={s.request.request_id: d for s, d in zip(out.scheduled, drafts) if d},
        )

    def _propose(self, scheduled: list[ScheduledRequest], starts: list[int], emitted: dict[int, list[int]],
                 hidden, input_ids, positions, common) -> list[list[int]]:
        """Each scheduled request's drafts for the next step (none where it did not sample)."""
        proposals = []
        for s, start in zip(scheduled, starts):
            new = emitted.get(id(s), [])
            kept = s.num_new_tokens - s.num_drafts + max(len(new) - 1, 0)
            wanted = self._num_drafts(s.request, s.num_computed_tokens + kept) if new else 0
            proposals.append(Proposal(s, start, new, kept, wanted))
        return self.proposer.propose(proposals, input_ids, positions, hidden, common)

    def _num_drafts(self, request: Request, num_computed: int) -> int:
        """Drafts worth proposing: none for requests verification cannot serve; chained ones stay within the
        slots the scheduler reserved (max_model_len)."""
        if not supports_speculation(request):
            return 0
        return max(0, min(self.k, self.max_model_len - num_computed + 1))
