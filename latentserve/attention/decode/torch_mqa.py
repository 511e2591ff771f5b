"""TORCH: batched absorbed MQA over the gathered latent rows (never per-head K/V)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from latentserve.attention.decode.base import MLADecodeBackend
from latentserve.attention.kv_cache import dequantize_rows
from latentserve.attention.metadata import MLADecodeMetadata

REDUCED_PRECISION = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class GatherGroup:
    """Requests `start..end`: the cache blocks to gather for them, and which gathered rows lie past their ends."""

    start: int
    end: int
    blocks: torch.Tensor  # [(end - start) * blocks_per_request] block ids, request by request
    seq_lens: torch.Tensor  # [end - start] int64
    first: int  # every row before this is inside every request of the group
    past_end: torch.Tensor  # [end - start, rows - first] bool


@dataclass(frozen=True)
class TorchPlan:
    """The step's gather groups, made by the first layer and reused by the others through the metadata."""

    key: tuple[int, int, bool]  # (block size, cache row bytes, several query tokens per request)
    groups: list[GatherGroup]


class TorchMQADecodeBackend(MLADecodeBackend):
    supports_sliding_window = True

    @classmethod
    def get_name(cls) -> str:
        return "TORCH"

    # Requests are attended in groups whose gathered latents stay cache-sized: a batch-wide gather buffer
    # is written and read back through memory, and that second trip exceeds the math on CPU.
    gather_bytes: int = 4 << 20

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: MLADecodeMetadata) -> torch.Tensor:
        plan = self._plan(metadata, kv_cache)
        if len(plan.groups) == 1:
            return self._forward_group(q, kv_cache, plan.groups[0], metadata)
        out = q.new_empty(q.shape[0], q.shape[1], self.kv_lora_rank)
        for group in plan.groups:
            out[group.start : group.end] = self._forward_group(q[group.start : group.end], kv_cache, group, metadata)
        return out

    def _forward_group(
        self, q: torch.Tensor, kv_cache: torch.Tensor, group: GatherGroup, metadata: MLADecodeMetadata
    ) -> torch.Tensor:
        num_reqs = group.end - group.start
        # index_select of whole blocks is a plain row copy, several times faster on CPU than indexing. The rows
        # are kept padded to whole blocks: cutting them to the longest request would make the batch
        # non-contiguous, and bmm would copy it again.
        kv = kv_cache.index_select(0, group.blocks).view(num_reqs, -1, kv_cache.shape[-1])
        kv = dequantize_rows(kv, self.kv_lora_rank, q.dtype)
        # Rows past a request's end may hold anything (even NaN), and a 0 weight times NaN is NaN: zero them.
        kv[:, group.first :].masked_fill_(group.past_end.unsqueeze(-1), 0.0)
        # Reduced-precision bmm (oneDNN) copies a strided operand: multiplying the whole rows (values and
        # rope keys, 12 % more math for DeepSeek's 512 + 64) and dropping the rope columns after is cheaper.
        values = kv if kv.dtype in REDUCED_PRECISION else kv[..., : self.kv_lora_rank]
        if q.shape[0] != num_reqs:
            return self._forward_multi_token(q, kv, values, group, metadata)
        scores = torch.bmm(q * self.scale, kv.transpose(1, 2))  # [R, N, S]; scaling q costs less than the scores
        scores[:, :, group.first :].masked_fill_(group.past_end[:, None, :], float("-inf"))
        if self.sliding_window is not None:
            positions = torch.arange(kv.shape[1], device=q.device)
            behind = positions[None, :] <= group.seq_lens[:, None] - 1 - self.sliding_window
            scores.masked_fill_(behind[:, None, :], float("-inf"))
        return torch.bmm(torch.softmax(scores, dim=-1), values)[..., : self.kv_lora_rank]

    def _forward_multi_token(
        self, q: torch.Tensor, kv: torch.Tensor, values: torch.Tensor, group: GatherGroup, metadata: MLADecodeMetadata
    ) -> torch.Tensor:
        """Several new tokens per request (speculative decoding): pad queries per request, mask causally."""
        num_reqs = group.seq_lens.shape[0]
        req_idx, col_idx = _token_coordinates(metadata, q.shape[0])
        qp = q.new_zeros(num_reqs, metadata.max_query_len, q.shape[1], q.shape[2])
        qp[req_idx, col_idx] = q * self.scale
        width = metadata.max_query_len * q.shape[1]
        scores = torch.bmm(qp.view(num_reqs, width, -1), kv.transpose(1, 2))
        scores = scores.view(num_reqs, metadata.max_query_len, q.shape[1], -1)
        query_lens = (metadata.query_start_loc[1:] - metadata.query_start_loc[:-1]).long()
        last_key = (group.seq_lens - query_lens)[:, None] + torch.arange(metadata.max_query_len, device=q.device)[None, :]
        positions = torch.arange(kv.shape[1], device=q.device)
        scores.masked_fill_(positions[None, None, None, :] > last_key[:, :, None, None], float("-inf"))
        if self.sliding_window is not None:
            behind = positions[None, None, None, :] <= last_key[:, :, None, None] - self.sliding_window
            scores.masked_fill_(behind, float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(num_reqs, width, -1)
        out = torch.bmm(probs, values)[..., : self.kv_lora_rank]
        return out.reshape(num_reqs, metadata.max_query_len, q.shape[1], -1)[req_idx, col_idx]

    def _plan(self, metadata: MLADecodeMetadata, kv_cache: torch.Tensor) -> TorchPlan:
        """Split the requests into gather groups once per step (per ubatch: the metadata is the ubatch's own)."""
        num_reqs = metadata.seq_lens.shape[0]
        multi_token = metadata.max_query_len > 1
        key = (kv_cache.shape[1], kv_cache.shape[-1] * kv_cache.element_size(), multi_token)
        plan = metadata.backend_plan
        if isinstance(plan, TorchPlan) and plan.key == key:
            return plan
        group = num_reqs  # queries padded per request need the whole batch at once
        if not multi_token:
            group = self.gather_bytes // max(metadata.max_seq_len * key[1], 1)
        group = max(group, 1)
        groups = [self._group(metadata, start, min(start + group, num_reqs), key[0])
                  for start in range(0, num_reqs, group)]
        plan = TorchPlan(key, groups)
        metadata.backend_plan = plan
        return plan

    @staticmethod
    def _group(metadata: MLADecodeMetadata, start: int, end: int, block_size: int) -> GatherGroup:
        seq_lens = metadata.seq_lens[start:end].long()
        on_cpu = seq_lens.device.type == "cpu"
        # On an accelerator reading the lengths would sync: use the batch maximum there.
        max_len = int(seq_lens.max()) if on_cpu else metadata.max_seq_len
        first = int(seq_lens.min()) if on_cpu else 0
        num_blocks = -(-max_len // block_size)
        positions = torch.arange(first, num_blocks * block_size, device=seq_lens.device)
        return GatherGroup(
            start=start,
            end=end,
            blocks=metadata.block_table[start:end, :num_blocks].flatten(),
            seq_lens=seq_lens,
            first=first,
            past_end=positions[None, :] >= seq_lens[:, None],
        )


def _token_coordinates(metadata: MLADecodeMetadata, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(request index, index within the request) of every decode token."""
    qsl = metadata.query_start_loc.long()
    tokens = torch.arange(num_tokens, device=qsl.device)
    req_idx = torch.searchsorted(qsl[1:], tokens, right=True)
    return req_idx, tokens - qsl[req_idx]
