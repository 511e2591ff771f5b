"""Backend-neutral batch description and the MLA metadata built from it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from latentserve.attention.dsa.metadata import DSAMetadata
    from latentserve.attention.prefill.base import MLAPrefillBackend


@dataclass
class CommonAttentionMetadata:
    """One batch of requests, each with `query_len` new tokens at the end of `seq_len` tokens.

    Tensors live on the compute device; `*_cpu` copies let builders plan without a device sync.
    """

    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, cumulative new tokens
    seq_lens: torch.Tensor  # [num_reqs] int32, context + new tokens
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64, -1 = padding (not written)
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    # Hybrid models: each request's slot in the linear-attention state pool (engine/state_pool.py); None: no such
    # layers.
    state_slots_cpu: torch.Tensor | None = None

    @classmethod
    def from_lists(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        device: torch.device | str = "cpu",
        state_slots: list[int] | None = None,
    ) -> "CommonAttentionMetadata":
        """Build from per-request lengths, validating them."""
        if len(query_lens) != len(seq_lens):
            raise ValueError(f"{len(query_lens)} query lengths but {len(seq_lens)} sequence lengths")
        for i, (q, s) in enumerate(zip(query_lens, seq_lens)):
            if q < 0 or s < q:
                raise ValueError(f"request {i}: query_len {q} and seq_len {s} need 0 <= query_len <= seq_len")
        if block_table.dim() != 2 or block_table.shape[0] != len(seq_lens):
            raise ValueError(f"block_table must be [num_reqs={len(seq_lens)}, max_blocks], got {tuple(block_table.shape)}")
        qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0)
        num_tokens = int(qsl[-1])
        if slot_mapping.shape != (num_tokens,):
            raise ValueError(f"slot_mapping must have {num_tokens} entries, got {tuple(slot_mapping.shape)}")
        sl = torch.tensor(seq_lens, dtype=torch.int32)
        if state_slots is not None and len(state_slots) != len(seq_lens):
            raise ValueError(f"{len(state_slots)} state slots for {len(seq_lens)} requests")
        return cls(
            query_start_loc=qsl.to(device),
            seq_lens=sl.to(device),
            block_table=block_table.to(device=device, dtype=torch.int32),
            slot_mapping=slot_mapping.to(device=device, dtype=torch.int64),
            num_reqs=len(query_lens),
            num_actual_tokens=num_tokens,
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=sl,
            state_slots_cpu=None if state_slots is None else torch.tensor(state_slots, dtype=torch.int64),
        )

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]

    @property
    def num_computed_tokens_cpu(self) -> torch.Tensor:
        """Tokens of each request already in the KV cache before this step."""
        return self.seq_lens_cpu - self.query_lens_cpu


@dataclass
class MLADecodeMetadata:
    """Decode requests: a few new tokens each, attended over the paged latent cache."""

    block_table: torch.Tensor  # [num_decodes, max_blocks]
    seq_lens: torch.Tensor  # [num_decodes]
    query_start_loc: torch.Tensor  # [num_decodes + 1], starts at 0
    max_query_len: int
    max_seq_len: int
    # What a decode backend derives from these tensors once per step (the first layer), for every layer
    # of this ubatch; it lives here because the metadata belongs to exactly one ubatch.
    backend_plan: Any = None


@dataclass
class ChunkedContextMetadata:
    """Plan for reading prefills' cached context, one bounded workspace chunk at a time.

    Chunk `c` holds, for each prefill request, the context tokens
    `[c * chunk_size, min((c + 1) * chunk_size, context_len))`, packed back to back.
    """

    chunk_size: int
    slots: list[torch.Tensor]  # per chunk: flat cache slots to gather, [chunk_tokens]
    cu_seq_lens: list[torch.Tensor]  # per chunk: [num_prefills + 1] offsets into the gathered rows
    cu_seq_lens_cpu: list[list[int]]
    workspace: torch.Tensor  # [workspace_tokens, widest kv_cache_dim], owned by one builder


@dataclass
class MLAPrefillMetadata:
    """Prefill requests: new tokens attended causally, plus their cached context by chunks."""

    query_start_loc: torch.Tensor  # [num_prefills + 1], rebased to start at 0
    query_start_loc_cpu: list[int]
    context_lens_cpu: list[int]
    max_query_len: int
    chunked_context: ChunkedContextMetadata | None
    # Layer name -> the builder's own backend instance for that layer's shape, prepared with this metadata (the
    # seed's fix).
    backends: "dict[str, MLAPrefillBackend]"


@dataclass
class StateMetadata:
    """What a linear-attention layer reads in one forward of one ubatch: each request's tokens and state slot."""

    query_start_loc_cpu: list[int]  # [num_reqs + 1]
    context_lens_cpu: list[int]  # 0: the request starts here, from a zero state
    slots: list[int]  # each request's slot in the state pool


@dataclass
class MLAMetadata:
    """Everything an MLA layer reads in one forward of one ubatch; decodes come first."""

    num_actual_tokens: int
    slot_mapping: torch.Tensor
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    decode: MLADecodeMetadata | None
    prefill: MLAPrefillMetadata | None
    builder_id: int
    dsa: "DSAMetadata | None" = None  # the layers' DeepSeek Sparse Attention, where they have it
    states: StateMetadata | None = None  # a hybrid model's linear-attention layers, where it has them
