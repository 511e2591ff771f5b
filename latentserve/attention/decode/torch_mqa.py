"""TORCH: batched absorbed MQA over the gathered latent rows (never per-head K/V)."""
from __future__ import annotations

import torch

from latentserve.attention.decode.base import MLADecodeBackend
from latentserve.attention.metadata import MLADecodeMetadata


class TorchMQADecodeBackend(MLADecodeBackend):
    @classmethod
    def get_name(cls) -> str:
        return "TORCH"

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: MLADecodeMetadata) -> torch.Tensor:
        num_reqs = metadata.seq_lens.shape[0]
        block_size = kv_cache.shape[1]
        num_blocks = -(-metadata.max_seq_len // block_size)
        # index_select of whole blocks is a plain row copy, several times faster on CPU than indexing.
        blocks = metadata.block_table[:, :num_blocks].flatten()
        kv = kv_cache.index_select(0, blocks).view(num_reqs, num_blocks * block_size, -1).to(q.dtype)
        kv = kv[:, : metadata.max_seq_len]
        seq_lens = metadata.seq_lens.long()
        # Keys from `first` on lie past some request's end (on an accelerator, reading the shortest length
        # would sync, so every key counts as possibly past).
        first = int(seq_lens.min()) if seq_lens.device.type == "cpu" else 0
        ragged = first < kv.shape[1]
        if ragged:
            past_end = torch.arange(first, kv.shape[1], device=q.device)[None, :] >= seq_lens[:, None]  # [R, S-first]
            # Those rows may hold anything (even NaN), and a 0 weight times NaN is NaN: zero them.
            kv[:, first:].masked_fill_(past_end.unsqueeze(-1), 0.0)
        if q.shape[0] == num_reqs:  # one new token per request: its causal mask is the padding mask
            scores = torch.matmul(q, kv.transpose(1, 2)).mul_(self.scale)  # [R, N, S]
            if ragged:
                scores[..., first:].masked_fill_(past_end[:, None, :], float("-inf"))
            return torch.matmul(torch.softmax(scores, dim=-1), kv[..., : self.kv_lora_rank])
        return self._forward_multi_token(q, kv, seq_lens, metadata)

    def _forward_multi_token(
        self, q: torch.Tensor, kv: torch.Tensor, seq_lens: torch.Tensor, metadata: MLADecodeMetadata
    ) -> torch.Tensor:
        """Several new tokens per request (speculative decoding): pad queries per request, mask causally."""
        num_reqs = seq_lens.shape[0]
        req_idx, col_idx = _token_coordinates(metadata, q.shape[0])
        qp = q.new_zeros(num_reqs, metadata.max_query_len, q.shape[1], q.shape[2])
        qp[req_idx, col_idx] = q
        width = metadata.max_query_len * q.shape[1]
        scores = torch.matmul(qp.view(num_reqs, width, -1), kv.transpose(1, 2)).mul_(self.scale)
        scores = scores.view(num_reqs, metadata.max_query_len, q.shape[1], -1)
        query_lens = (metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]).long()
        last_key = (seq_lens - query_lens)[:, None] + torch.arange(metadata.max_query_len, device=q.device)[None, :]
        positions = torch.arange(kv.shape[1], device=q.device)
        scores.masked_fill_(positions[None, None, None, :] > last_key[:, :, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(num_reqs, width, -1)
        out = torch.matmul(probs, kv[..., : self.kv_lora_rank])
        return out.view(num_reqs, metadata.max_query_len, q.shape[1], -1)[req_idx, col_idx]


def _token_coordinates(metadata: MLADecodeMetadata, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(request index, index within the request) of every decode token."""
    qsl = metadata.query_start_loc.long()
    tokens = torch.arange(num_tokens, device=qsl.device)
    req_idx = torch.searchsorted(qsl[1:], tokens, right=True)
    return req_idx, tokens - qsl[req_idx]
