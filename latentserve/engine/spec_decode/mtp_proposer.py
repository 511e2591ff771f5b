"""`MTPProposer`: runs the MTP layer after each main-model step and proposes the next step's drafts.

Every position p the main model computed (and kept) this step pairs its hidden state h_p with token p+1, now known
(the next prompt token, an accepted draft, or the token just sampled); the MTP layer runs over those pairs, so its
own KV cache follows the main model's. A request that samples then gets its first draft from the MTP's output at
its last pair, and k > 1 chains the layer on its own output. Drafts are the MTP's argmax: a one-hot draft
distribution, which rejection sampling verifies exactly at any temperature.

The MTP cache has the main cache's geometry and shares its block tables: position p of a request lives in the same
slot in both. Chained drafts write slots past the request's verified tokens; the scheduler reserves them
(`num_lookahead_tokens`), and the next step overwrites them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from latentserve.attention.builder import MLAMetadataBuilder, is_decode
from latentserve.attention.kv_cache import allocate_kv_caches
from latentserve.attention.metadata import CommonAttentionMetadata
from latentserve.config import AttentionConfig
from latentserve.models.mtp import DeepseekMTP
from latentserve.ubatch.dbo import run_forward


@dataclass
class DraftRequest:
    """One request's part of an MTP step: pairs at positions start.., and how many drafts it wants after them."""

    start: int
    token_ids: list[int]  # t_{p+1} for each pair position p
    block_ids: list[int]
    num_drafts: int  # 0: the request does not sample this step (or drafts nothing)


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
        self.decode_threshold = attn_config.decode_threshold
        self.device = torch.device(device)
        self.kv_caches = allocate_kv_caches(
            mtp.static_forward_context, num_blocks, attn_config.block_size, kv_cache_dtype, device
        )
        self.builder = MLAMetadataBuilder(
            mtp.attention_layer_names, mtp.static_forward_context, mtp.mla_config, attn_config, device
        )

    @torch.no_grad()
    def propose(self, requests: list[DraftRequest], hidden: torch.Tensor) -> list[list[int]]:
        """hidden `[sum of pairs, hidden]`: h_p of every pair, in request order -> each request's drafts."""
        drafts: list[list[int]] = [[] for _ in requests]
        order = [i for i, r in enumerate(requests) if r.token_ids]
        # The attention builder wants decodes first.
        order.sort(key=lambda i: not is_decode(len(requests[i].token_ids), requests[i].start, self.decode_threshold))
        if not order:
            return drafts
        offsets = [0]
        for r in requests:
            offsets.append(offsets[-1] + len(r.token_ids))
        rows = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in order]).to(hidden.device)
        batch = [(requests[i].start, requests[i].token_ids, requests[i].block_ids) for i in order]
        out = self._forward(batch, hidden[rows])
        wanting = [(j, i) for j, i in enumerate(order) if requests[i].num_drafts > 0]
        if not wanting:
            return drafts
        ends = torch.tensor([sum(len(requests[i].token_ids) for i in order[: j + 1]) - 1 for j, i in wanting])
        last_hidden = out[ends.to(out.device)]
        tokens = self.mtp.compute_logits(last_hidden).argmax(-1).tolist()
        positions = [requests[i].start + len(requests[i].token_ids) for _, i in wanting]
        for step in range(max(requests[i].num_drafts for _, i in wanting)):
            for (_, i), token in zip(wanting, tokens):
                if len(drafts[i]) < requests[i].num_drafts:
                    drafts[i].append(token)
            if step + 1 == max(requests[i].num_drafts for _, i in wanting):
                break
            # Chain: the MTP's own output stands in for the main model's hidden state at the drafted position.
            batch = [(p, [t], requests[i].block_ids) for p, t, (_, i) in zip(positions, tokens, wanting)]
            last_hidden = self._forward(batch, last_hidden)
            tokens = self.mtp.compute_logits(last_hidden).argmax(-1).tolist()
            positions = [p + 1 for p in positions]
        return drafts

    def _forward(self, batch: list[tuple[int, list[int], list[int]]], hidden: torch.Tensor) -> torch.Tensor:
        """One MTP forward over (start position, tokens, block table) per request, decodes first."""
        bs = self.block_size
        ids, positions, slots = [], [], []
        for start, tokens, blocks in batch:
            for p in range(start, start + len(tokens)):
                positions.append(p)
                slots.append(blocks[p // bs] * bs + p % bs)
            ids += tokens
        width = max(len(blocks) for _, _, blocks in batch)
        table = torch.zeros(len(batch), width, dtype=torch.int32)
        for row, (_, _, blocks) in enumerate(batch):
            table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        common = CommonAttentionMetadata.from_lists(
            [len(t) for _, t, _ in batch], [s + len(t) for s, t, _ in batch], table,
            torch.tensor(slots, dtype=torch.int64), device=self.device,
        )
        inputs = [torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device), hidden]
        return run_forward(self.mtp, inputs, common, [self.builder])
