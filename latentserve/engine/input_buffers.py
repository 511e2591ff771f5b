"""A step's model inputs written into buffers kept across steps (vLLM's persistent input batch)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from latentserve.attention.metadata import CommonAttentionMetadata
from latentserve.engine.scheduler_output import SchedulerOutput


@dataclass
class StepInputs:
    """Views into the buffers, valid until the next `prepare()`."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_indices: torch.Tensor
    common: CommonAttentionMetadata


class _Buffer:
    """A host tensor with a numpy view for cheap filling from lists, and its device copy when not on CPU."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        on_cpu = device.type == "cpu"
        self.cpu = torch.zeros(size, dtype=dtype, pin_memory=not on_cpu and torch.cuda.is_available())
        self.np = self.cpu.numpy()
        self.device = self.cpu if on_cpu else torch.zeros(size, dtype=dtype, device=device)

    def to_device(self, n: int) -> torch.Tensor:
        if self.device is self.cpu:
            return self.cpu[:n]
        return self.device[:n].copy_(self.cpu[:n], non_blocking=True)


class InputBuffers:
    """Grows to the largest step seen (doubling), then allocates nothing per step."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.max_tokens = self.max_reqs = self.max_table = 0
        self._arange = np.zeros(0, dtype=np.int64)

    def _reserve(self, num_tokens: int, num_reqs: int, table_entries: int) -> None:
        if num_tokens > self.max_tokens:
            self.max_tokens = max(num_tokens, 2 * self.max_tokens)
            self.input_ids = _Buffer(self.max_tokens, torch.long, self.device)
            self.positions = _Buffer(self.max_tokens, torch.long, self.device)
            self.slot_mapping = _Buffer(self.max_tokens, torch.long, self.device)
            self._arange = np.arange(self.max_tokens, dtype=np.int64)
        if num_reqs > self.max_reqs:
            self.max_reqs = max(num_reqs, 2 * self.max_reqs)
            self.query_start_loc = _Buffer(self.max_reqs + 1, torch.int32, self.device)
            self.seq_lens = _Buffer(self.max_reqs, torch.int32, self.device)
            self.logits_indices = _Buffer(self.max_reqs, torch.long, self.device)
        if table_entries > self.max_table:
            self.max_table = max(table_entries, 2 * self.max_table)
            self.block_table = _Buffer(self.max_table, torch.int32, self.device)

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        scheduled = out.scheduled
        num_reqs = len(scheduled)
        width = max(len(s.block_ids) for s in scheduled)
        num_tokens = sum(s.num_new_tokens for s in scheduled)
        self._reserve(num_tokens, num_reqs, num_reqs * width)
        ids, pos, slots = self.input_ids.np, self.positions.np, self.slot_mapping.np
        qsl, seq_lens, logits = self.query_start_loc.np, self.seq_lens.np, self.logits_indices.np
        # A fresh [num_reqs, width] view each step keeps the table contiguous; padding is block 0.
        table = self.block_table.np[: num_reqs * width].reshape(num_reqs, width)
        qsl[0] = 0
        start = num_sampled = max_query_len = max_seq_len = 0
        for i, s in enumerate(scheduled):
            end = start + s.num_new_tokens
            ids[start:end] = s.token_ids
            np.add(self._arange[: s.num_new_tokens], s.num_computed_tokens, out=pos[start:end])
            slots[start:end] = s.slot_mapping
            num_blocks = len(s.block_ids)
            table[i, :num_blocks] = s.block_ids
            table[i, num_blocks:] = 0
            seq_lens[i] = seq_len = s.num_computed_tokens + s.num_new_tokens
            max_query_len, max_seq_len = max(max_query_len, s.num_new_tokens), max(max_seq_len, seq_len)
            qsl[i + 1] = end
            if s.do_sample:
                logits[num_sampled] = end - 1
                num_sampled += 1
            start = end
        common = CommonAttentionMetadata(
            query_start_loc=self.query_start_loc.to_device(num_reqs + 1),
            seq_lens=self.seq_lens.to_device(num_reqs),
            block_table=self.block_table.to_device(num_reqs * width).view(num_reqs, width),
            slot_mapping=self.slot_mapping.to_device(num_tokens),
            num_reqs=num_reqs,
            num_actual_tokens=num_tokens,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            query_start_loc_cpu=self.query_start_loc.cpu[: num_reqs + 1],
            seq_lens_cpu=self.seq_lens.cpu[:num_reqs],
            state_slots_cpu=(None if scheduled[0].state_slot is None
                             else torch.tensor([s.state_slot for s in scheduled], dtype=torch.int64)),
        )
        return StepInputs(
            self.input_ids.to_device(num_tokens), self.positions.to_device(num_tokens),
            self.logits_indices.to_device(num_sampled), common,
        )
