"""TORCH: batched absorbed MQA over the gathered latent rows (never per-head K/V)."""
from __future__ import annotations

import torch

from latentserve.attention.decode.base import MLADecodeBackend
from latentserve.attention.metadata import MLADecodeMetadata


class TorchMQADecodeBackend(MLADecodeBackend):
    @classmethod
    def get_name(cls) -> str:
        return "TORCH"

    # Requests are attended in groups whose gathered latents stay cache-sized: one batch-wide gather
    # buffer costs fresh-page faults and a second trip through memory that exceed the math on CPU.
    gather_bytes: int = 4 << 20

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: MLADecodeMetadata) -> torch.Tensor:
        num_reqs = metadata.seq_lens.shape[0]
        if q.shape[0] != num_reqs:
            kv, seq_lens = self._gather(kv_cache, metadata, 0, num_reqs, q.dtype)
            return self._forward_multi_token(q, kv, seq_lens, metadata)
        row_bytes = metadata.max_seq_len * kv_cache.shape[-1] * kv_cache.element_size()
        group = max(1, self.gather_bytes // max(row_bytes, 1))
        if group >= num_reqs:
            return self._forward_single_token(q, *self._gather(kv_cache, metadata, 0, num_reqs, q.dtype))
        out = q.new_empty(num_reqs, q.shape[1], self.kv_lora_rank)
        for start in range(0, num_reqs, group):
            end = min(start + group, num_reqs)
            out[start:end] = self._forward_single_token(q[start:end], *self._gather(kv_cache, metadata, start, end, q.dtype))
        return out

    @staticmethod
    def _gather(
        kv_cache: torch.Tensor, metadata: MLADecodeMetadata, start: int, end: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent rows of requests start..end as `[R, S, L+R]`, rows past each request's end zeroed."""
        seq_lens = metadata.seq_lens[start:end].long()
        # On an accelerator reading the longest length would sync: use the batch maximum there.
        max_len = int(seq_lens.max()) if seq_lens.device.type == "cpu" else metadata.max_seq_len
        block_size = kv_cache.shape[1]
        num_blocks = -(-max_len // block_size)
        # index_select of whole blocks is a plain row copy, several times faster on CPU than indexing.
        blocks = metadata.block_table[start:end, :num_blocks].flatten()
        kv = kv_cache.index_select(0, blocks).view(end - start, num_blocks * block_size, -1).to(dtype)
        kv = kv[:, :max_len]
        first = int(seq_lens.min()) if seq_lens.device.type == "cpu" else 0
        if first < kv.shape[1]:
            past_end = torch.arange(first, kv.shape[1], device=kv.device)[None, :] >= seq_lens[:, None]
            # Those rows may hold anything (even NaN), and a 0 weight times NaN is NaN: zero them.
            kv[:, first:].masked_fill_(past_end.unsqueeze(-1), 0.0)
        return kv, seq_lens

    def _forward_single_token(self, q: torch.Tensor, kv: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """One new token per request: its causal mask is the padding mask."""
        scores = torch.matmul(q, kv.transpose(1, 2)).mul_(self.scale)  # [R, N, S]
        positions = torch.arange(kv.shape[1], device=kv.device)
        scores.masked_fill_((positions[None, :] >= seq_lens[:, None])[:, None, :], float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), kv[..., : self.kv_lora_rank])

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
