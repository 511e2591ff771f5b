"""PAGED: absorbed MQA that reads each request's latents where they lie in the paged cache (CPU).

A request's blocks are read as runs of consecutive block ids: a run of at least `min_run_tokens`
tokens is a view of the cache (no copy) and goes straight into the GEMMs; the short runs between
them are copied together into one small buffer (fewer, larger GEMMs beat many tiny ones). The
request's scores over all its pieces, in position order, get one exact softmax.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from latentserve.attention.decode.base import MLADecodeBackend
from latentserve.attention.metadata import MLADecodeMetadata


@dataclass(frozen=True)
class Piece:
    """`num_rows` consecutive positions of one request: cache rows from `flat_start`, or these blocks copied."""

    num_rows: int
    flat_start: int = -1
    block_ids: torch.Tensor | None = None


@dataclass(frozen=True)
class PagedPlan:
    """Per decode request: its query token range and its pieces in position order."""

    block_size: int
    query_ranges: list[tuple[int, int]]
    pieces: list[list[Piece]]


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

    # Shorter runs are copied: below this a GEMM call costs more than copying its rows.
    min_run_tokens: int = 64

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: MLADecodeMetadata) -> torch.Tensor:
        plan = self._plan(metadata, kv_cache.shape[1])
        num_heads, latent = q.shape[1], self.kv_lora_rank
        flat = kv_cache.view(-1, kv_cache.shape[-1])
        blocks = kv_cache.view(kv_cache.shape[0], -1)
        q = q * self.scale  # scaling the queries once costs less than scaling every score
        out = q.new_empty(q.shape[0], num_heads, latent)
        for (q_start, q_end), pieces in zip(plan.query_ranges, plan.pieces):
            rows = [self._rows(p, flat, blocks, q.dtype) for p in pieces]
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
    def _rows(piece: Piece, flat: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if piece.block_ids is None:
            rows = flat[piece.flat_start : piece.flat_start + piece.num_rows]
        else:
            rows = blocks.index_select(0, piece.block_ids).view(-1, flat.shape[-1])[: piece.num_rows]
        return rows.to(dtype)

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
        if isinstance(plan, PagedPlan) and plan.block_size == block_size:
            return plan
        qsl = metadata.query_start_loc.tolist()
        seq_lens = metadata.seq_lens.tolist()
        table = metadata.block_table.tolist()
        pieces = [plan_pieces(table[r], s, block_size, self.min_run_tokens) for r, s in enumerate(seq_lens)]
        plan = PagedPlan(block_size, list(zip(qsl[:-1], qsl[1:])), pieces)
        metadata.backend_plan = plan
        return plan
