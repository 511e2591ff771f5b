"""`MTPProposer`: runs the MTP layer after each main-model step and proposes the next step's drafts.

Every position p the main model computed this step pairs its hidden state h_p with token p+1: the next prompt
token, an accepted draft, or the token just sampled. The MTP layer runs over the main step's own batch layout
(vLLM's padded drafter batch): the same positions, slots and attention metadata, token ids shifted by one, each
request's last kept pair given the token that follows it. Pairs past a rejected draft are computed too; their
cache slots lie past the verified tokens and are overwritten before anything attends to them. So the MTP's own KV
cache follows the main model's, and the step builds nothing per request. A request that samples then gets its
first draft from the MTP's output at its last kept pair, and k > 1 chains the layer on its own output. Drafts are
the MTP's argmax: a one-hot draft distribution, which rejection sampling verifies exactly at any temperature.

The MTP cache has the main cache's geometry and shares its block tables: position p of a request lives in the same
slot in both. Chained drafts write slots past the request's verified tokens; the scheduler reserves them
(`num_lookahead_tokens`), and the next step overwrites them.

The MTP forward is not split into DBO ubatches: its layer holds every expert on each rank (no all-to-all), so
there is no communication for a second ubatch to hide, only the cost of a second, smaller pass.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from latentserve.attention.builder import MLAMetadataBuilder
from latentserve.attention.kv_cache import allocate_kv_caches
from latentserve.attention.metadata import CommonAttentionMetadata
from latentserve.config import AttentionConfig
from latentserve.engine.argmax import argmax
from latentserve.engine.spec_decode.proposal import Proposal
from latentserve.models.mtp import DeepseekMTP
from latentserve.ubatch.dbo import run_forward


@dataclass
class DraftRequest:
    """One request's part of an MTP step."""

    last_row: int  # its last kept pair's row in the step's batch
    next_token: int  # the token that pair reads (the one after its position)
    next_position: int  # the position after that pair: where a chained draft's pair sits
    block_ids: list[int]
    num_drafts: int  # 0: the request does not sample this step (or drafts nothing)


def _draft_request(p: Proposal) -> DraftRequest:
    next_token = p.emitted[-1] if p.emitted else p.scheduled.request.all_token_ids[p.end]
    return DraftRequest(p.start + p.kept - 1, next_token, p.end, p.scheduled.block_ids, p.num_drafts)


class MTPProposer:
    def __init__(
        self,
        mtp: DeepseekMTP,
        attn_config: AttentionConfig,
        num_blocks: int,
        kv_cache_dtype: torch.dtype,
        num_speculative_tokens: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.mtp = mtp
        self.k = num_speculative_tokens
        self.block_size = attn_config.block_size
        self.device = torch.device(device)
        self.kv_caches = allocate_kv_caches(
            mtp.static_forward_context, num_blocks, attn_config.block_size, kv_cache_dtype, device
        )
        self.builder = MLAMetadataBuilder(
            mtp.attention_layer_names, mtp.static_forward_context, attn_config, device
        )

    @torch.no_grad()
    def propose(
        self, proposals: list[Proposal], input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
        common: CommonAttentionMetadata,
    ) -> list[list[int]]:
        """The main step's input ids, positions, output hidden states `[T, hidden]` and attention metadata ->
        each request's drafts. Pair p holds h_p and token p+1; a request's last kept pair reads the token it sampled
        (or its next prompt token)."""
        return self._draft([_draft_request(p) for p in proposals], input_ids, positions, hidden, common)

    def _draft(self, requests: list[DraftRequest], input_ids: torch.Tensor, positions: torch.Tensor,
               hidden: torch.Tensor, common: CommonAttentionMetadata) -> list[list[int]]:
        ids = input_ids.roll(-1)
        ids[torch.tensor([r.last_row for r in requests], device=ids.device)] = torch.tensor(
            [r.next_token for r in requests], dtype=ids.dtype, device=ids.device)
        out = run_forward(self.mtp, [ids, positions, hidden], common, [self.builder])
        drafts: list[list[int]] = [[] for _ in requests]
        wanting = [i for i, r in enumerate(requests) if r.num_drafts > 0]
        if not wanting:
            return drafts
        last_hidden = out[torch.tensor([requests[i].last_row for i in wanting], device=out.device)]
        tokens = argmax(self.mtp.compute_logits(last_hidden)).tolist()
        chain = [requests[i].next_position for i in wanting]
        longest = max(requests[i].num_drafts for i in wanting)
        for step in range(longest):
            for i, token in zip(wanting, tokens):
                if len(drafts[i]) < requests[i].num_drafts:
                    drafts[i].append(token)
            if step + 1 == longest:
                break
            # Chain: the MTP's own output stands in for the main model's hidden state at the drafted position.
            batch = [(p, t, requests[i].block_ids) for p, t, i in zip(chain, tokens, wanting)]
            last_hidden = self._decode(batch, last_hidden)
            tokens = argmax(self.mtp.compute_logits(last_hidden)).tolist()
            chain = [p + 1 for p in chain]
        return drafts

    def _decode(self, batch: list[tuple[int, int, list[int]]], hidden: torch.Tensor) -> torch.Tensor:
        """One MTP forward over one (position, token, block table) pair per request."""
        bs = self.block_size
        slots = [blocks[p // bs] * bs + p % bs for p, _, blocks in batch]
        width = max(len(blocks) for _, _, blocks in batch)
        table = torch.zeros(len(batch), width, dtype=torch.int32)
        for row, (_, _, blocks) in enumerate(batch):
            table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        common = CommonAttentionMetadata.from_lists(
            [1] * len(batch), [p + 1 for p, _, _ in batch], table, torch.tensor(slots, dtype=torch.int64),
            device=self.device,
        )
        ids = torch.tensor([t for _, t, _ in batch], device=self.device)
        positions = torch.tensor([p for p, _, _ in batch], device=self.device)
        return run_forward(self.mtp, [ids, positions, hidden], common, [self.builder])
