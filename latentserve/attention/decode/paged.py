"""PAGED: absorbed MQA that reads each request's latents where they lie in the paged cache (CPU).

A request's blocks are read as runs of consecutive block ids: a run of at least `min_run_tokens`
tokens is a view of the cache (no copy) and goes straight into the GEMMs; the short runs between
them are copied together into one small buffer (fewer, larger GEMMs beat many tiny ones). The
request's scores over all its pieces, in position order, get one exact softmax. Requests with no
run long enough (short or scattered contexts) have everything to copy anyway: they are attended
together as TORCH does, one batched GEMM pair instead of a loop of small ones; so are all the
requests of a batch of more than `max_in_place_requests`, where batching beats the copy saved.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from latentserve.attention.decode.base import MLADecodeBackend
from latentserve.attention.decode.torch_mqa import TorchMQADecodeBackend
from latentserve.attention.kv_cache import dequantize_rows
from latentserve.attention.metadata import MLADecodeMetadata


@dataclass(frozen=True)
class Piece:
    """`num_rows` consecutive positions of one request: cache rows from `flat_start`, or these blocks copied."""

    num_rows: int
    flat_start: int = -1
    block_ids: torch.Tensor | None = None


@dataclass(frozen=True)
class PagedPlan:
    """Per request read in place: its query token range and its pieces in position order; the others batched."""

    block_size: int
    min_run_tokens: int
    query_ranges: list[tuple[int, int]]
    pieces: list[list[Piece]]
    gathered: MLADecodeMetadata | None  # the requests with nothing to read in place
    gathered_tokens: torch.Tensor | None  # their query tokens in the batch


def plan_pieces(blocks: list[int], seq_len: int, block_size: int, min_run_tokens: int) -> list[Piece]:
    """Split one request's first `seq_len` positions into in-place runs and copied short runs."""
    num_blocks = -(-seq_len // block_size)
    pieces: list[Piece] = []
    short: list[int] = []  # blocks of short runs waiting to be copied together
    start = 0
    while start < num_blocks:
        end = start + 1
        while end < num_blocks and blocks[end] == blocks[end - 1] + 1:
            end += 1
        rows = min(end * block_size, seq_len) - start * block_size
        if rows >= min_run_tokens:
            _flush(short, pieces, block_size, seq_len, start)
            pieces.append(Piece(rows, flat_start=blocks[start] * block_size))
        else:
            short.extend(blocks[start:end])
        start = end
    _flush(short, pieces, block_size, seq_len, num_blocks)
    return pieces


def _flush(short: list[int], pieces: list[Piece], block_size: int, seq_len: int, end_block: int) -> None:
    """Append the pending short-run blocks (ending at block `end_block`) as one copied piece."""
    if not short:
        return
    # Only the request's last block can be partly filled, and it ends the copied piece when present.
    rows = len(short) * block_size - max(0, end_block * block_size - seq_len)
    pieces.append(Piece(rows, block_ids=torch.tensor(short, dtype=torch.long)))
    short.clear()


class PagedMQADecodeBackend(MLADecodeBackend):
    supported_device_types = ("cpu",)  # one small GEMM per request: a host loop, too chatty for a GPU

    @classmethod
    def get_name(cls) -> str:
        return "PAGED"

    # Shorter runs are copied: below this a request's own GEMM calls cost more than copying its rows
    # (measured on CPU with 16 heads: 4 x 68-token contexts took twice TORCH's time read in place).
    min_run_tokens: int = 128
    # Batches of more requests all take TORCH's batched path: one bmm over every request's gathered rows beat
    # these per-request GEMMs at 2-32 requests x 512-4096 tokens once TORCH stopped copying its operands
    # (bf16 and fp32, 16 heads x (256 + 32)); the copy saved in place wins only for a lone request.
    max_in_place_requests: int = 1

    def __init__(self, num_heads: int, scale: float, kv_lora_rank: int, qk_rope_head_dim: int, config: Any = None,
                 sliding_window: int | None = None):
        super().__init__(num_heads, scale, kv_lora_rank, qk_rope_head_dim, config, sliding_window)
        # For the requests with nothing to read in place.
        self.batched = TorchMQADecodeBackend(num_heads, scale, kv_lora_rank, qk_rope_head_dim, config)

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: MLADecodeMetadata) -> torch.Tensor:
        plan = self._plan(metadata, kv_cache.shape[1])
        if not plan.query_ranges:  # nothing to read in place
            return self.batched.forward(q, kv_cache, plan.gathered)
        num_heads, latent = q.shape[1], self.kv_lora_rank
        out = q.new_empty(q.shape[0], num_heads, latent)
        if plan.gathered is not None:
            tokens = plan.gathered_tokens
            out.index_copy_(0, tokens, self.batched.forward(q.index_select(0, tokens), kv_cache, plan.gathered))
        flat = kv_cache.view(-1, kv_cache.shape[-1])
        blocks = kv_cache.view(kv_cache.shape[0], -1)
        q = q * self.scale  # scaling the queries once costs less than scaling every score
        for (q_start, q_end), pieces in zip(plan.query_ranges, plan.pieces):
            rows = [dequantize_rows(self._rows(p, flat, blocks), latent, q.dtype) for p in pieces]
            q_r = q[q_start:q_end].view(-1, q.shape[-1])
            probs = self._probs(q_r, rows, q_end - q_start)
            out_r = out[q_start:q_end].view(-1, latent)
            offset = 0
            for i, kv in enumerate(rows):
                p = probs[:, offset : offset + kv.shape[0]]
                if i == 0:
                    torch.mm(p, kv[:, :latent], out=out_r)
                else:
                    out_r.addmm_(p, kv[:, :latent])
                offset += kv.shape[0]
        return out

    @staticmethod
    def _rows(piece: Piece, flat: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        if piece.block_ids is None:
            return flat[piece.flat_start : piece.flat_start + piece.num_rows]
        return blocks.index_select(0, piece.block_ids).view(-1, flat.shape[-1])[: piece.num_rows]

    @staticmethod
    def _probs(q_r: torch.Tensor, rows: list[torch.Tensor], query_len: int) -> torch.Tensor:
        """Softmax over the request's positions of every (query token, head) row of `q_r`."""
        if len(rows) == 1:
            scores = torch.mm(q_r, rows[0].T)
        else:
            scores = q_r.new_empty(q_r.shape[0], sum(kv.shape[0] for kv in rows))
            offset = 0
            for kv in rows:
                torch.mm(q_r, kv.T, out=scores[:, offset : offset + kv.shape[0]])
                offset += kv.shape[0]
        if query_len > 1:  # query token j sees all but the last query_len - 1 - j positions
            seq_len = scores.shape[1]
            tail = scores.view(query_len, -1, seq_len)[:, :, seq_len - query_len + 1 :]
            future = torch.ones(query_len, query_len - 1, dtype=torch.bool, device=q_r.device).triu()
            tail.masked_fill_(future[:, None, :], float("-inf"))
        return torch.softmax(scores, dim=-1)

    def _plan(self, metadata: MLADecodeMetadata, block_size: int) -> PagedPlan:
        """The step's read plan, made by the first layer and reused by the others through the metadata."""
        plan = metadata.backend_plan
        made_alike = isinstance(plan, PagedPlan) and (plan.block_size, plan.min_run_tokens) == (
            block_size, self.min_run_tokens)
        if made_alike:
            return plan
        if metadata.seq_lens.shape[0] > self.max_in_place_requests:
            # All batched, under a copy of the metadata whose backend_plan slot TORCH fills without evicting this.
            plan = PagedPlan(block_size, self.min_run_tokens, [], [], replace(metadata, backend_plan=None), None)
            metadata.backend_plan = plan
            return plan
        qsl = metadata.query_start_loc.tolist()
        seq_lens = metadata.seq_lens.tolist()
        table = metadata.block_table.tolist()
        ranges, pieces, batched = [], [], []
        for r, seq_len in enumerate(seq_lens):
            request_pieces = plan_pieces(table[r], seq_len, block_size, self.min_run_tokens)
            if any(p.block_ids is None for p in request_pieces):
                ranges.append((qsl[r], qsl[r + 1]))
                pieces.append(request_pieces)
            else:
                batched.append(r)
        gathered = tokens = None
        if batched and ranges:
            gathered, tokens = _sub_metadata(metadata, batched, qsl)
        elif batched:  # a copy for TORCH to plan on, as above
            gathered = replace(metadata, backend_plan=None)
        plan = PagedPlan(block_size, self.min_run_tokens, ranges, pieces, gathered, tokens)
        metadata.backend_plan = plan
        return plan


def _sub_metadata(
    metadata: MLADecodeMetadata, requests: list[int], qsl: list[int]
) -> tuple[MLADecodeMetadata, torch.Tensor]:
    """The decode metadata of some of the requests, and the indices of their query tokens in the batch."""
    index = torch.tensor(requests, dtype=torch.long, device=metadata.seq_lens.device)
    query_lens = [qsl[r + 1] - qsl[r] for r in requests]
    sub_qsl = [0]
    for n in query_lens:
        sub_qsl.append(sub_qsl[-1] + n)
    seq_lens = metadata.seq_lens.index_select(0, index)
    sub = MLADecodeMetadata(
        block_table=metadata.block_table.index_select(0, index),
        seq_lens=seq_lens,
        query_start_loc=torch.tensor(sub_qsl, dtype=metadata.query_start_loc.dtype, device=index.device),
        max_query_len=max(query_lens),
        max_seq_len=int(seq_lens.max()),
    )
    tokens = torch.cat([torch.arange(qsl[r], qsl[r + 1]) for r in requests]).to(index.device)
    return sub, tokens
