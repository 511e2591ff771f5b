"""`DSAMetadata`: what DeepSeek Sparse Attention reads of one ubatch, built by its metadata builder."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from latentserve.attention.dsa.state import TopKState
from latentserve.attention.kv_cache import slots_for_positions
from latentserve.attention.metadata import CommonAttentionMetadata


@dataclass
class DSAMetadata:
    """Tokens are the ubatch's, in its order (decodes first); request r's new tokens sit at positions
    `context_lens_cpu[r] + j`, its keys at `req_slots[r]` in every per-layer cache (one block table for all)."""

    topk: int
    # Every token sees at most `topk` positions: the selection would keep them all, so attend densely, as the
    # reference does when the context is shorter than top-k.
    dense: bool
    req_slots: list[torch.Tensor]  # per request: flat cache slots of positions [0, seq_len); none when dense
    query_start_loc_cpu: list[int]
    context_lens_cpu: list[int]
    workspace: torch.Tensor  # the builder's: gathers of selected rows
    state: TopKState  # the builder's: this forward's selection


class DSAMetadataBuilder:
    """The DSA part of one ubatch's metadata; owns the ubatch's top-k state (see `TopKState`)."""

    def __init__(self, topk: int, block_size: int, workspace: torch.Tensor, debug: bool, owner: object,
                 always_sparse: bool = False) -> None:
        if topk <= 0:
            raise ValueError(f"index_topk must be positive, got {topk}")
        if workspace.shape[0] < topk:
            raise ValueError(f"workspace_tokens={workspace.shape[0]} must hold one token's top-k rows ({topk})")
        self.topk = topk
        self.block_size = block_size
        self.always_sparse = always_sparse  # a layer has attention sinks, which only the sparse path computes
        self.workspace = workspace
        self.state = TopKState(debug)
        self.state.claim(owner)

    def build(self, common: CommonAttentionMetadata) -> DSAMetadata:
        seq_lens = common.seq_lens_cpu.tolist()
        dense = not self.always_sparse and max(seq_lens, default=0) <= self.topk
        bt_cpu = common.block_table.cpu()
        req_slots = [] if dense else [  # (a dense ubatch selects nothing)
            slots_for_positions(bt_cpu[r], torch.arange(n), self.block_size).to(common.block_table.device)
            for r, n in enumerate(seq_lens)]
        md = DSAMetadata(
            topk=self.topk,
            dense=dense,
            req_slots=req_slots,
            query_start_loc_cpu=common.query_start_loc_cpu.tolist(),
            context_lens_cpu=common.num_computed_tokens_cpu.tolist(),
            workspace=self.workspace,
            state=self.state,
        )
        self.state.reset(md)
        return md
