"""REFERENCE: per-token fp32 absorbed attention, the decode oracle."""
from __future__ import annotations

import torch

from latentserve.attention.decode.base import MLADecodeBackend
from latentserve.attention.kv_cache import dequantize_rows, slots_for_positions
from latentserve.attention.metadata import MLADecodeMetadata


class ReferenceDecodeBackend(MLADecodeBackend):
    supports_sliding_window = True

    @classmethod
    def get_name(cls) -> str:
        return "REFERENCE"

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: MLADecodeMetadata) -> torch.Tensor:
        flat = kv_cache.view(-1, kv_cache.shape[-1])
        out = q.new_empty(q.shape[0], q.shape[1], self.kv_lora_rank)
        qsl = metadata.query_start_loc.tolist()
        for r, seq_len in enumerate(metadata.seq_lens.tolist()):
            q_len = qsl[r + 1] - qsl[r]
            for j in range(q_len):
                visible = seq_len - q_len + j + 1
                first = 0 if self.sliding_window is None else max(0, visible - self.sliding_window)
                positions = torch.arange(first, visible, device=q.device)
                rows = flat[slots_for_positions(metadata.block_table[r], positions, kv_cache.shape[1])]
                rows = dequantize_rows(rows, self.kv_lora_rank, torch.float32)
                scores = q[qsl[r] + j].float() @ rows.T * self.scale
                out[qsl[r] + j] = (torch.softmax(scores, dim=-1) @ rows[:, : self.kv_lora_rank]).to(q.dtype)
        return out
