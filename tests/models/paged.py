"""Drive a model over a tiny paged KV cache, step by step, building the attention metadata by hand."""
from __future__ import annotations

import torch

from latentserve.attention.builder import MLAMetadataBuilder
from latentserve.attention.kv_cache import allocate_kv_caches
from latentserve.attention.metadata import CommonAttentionMetadata
from latentserve.config import AttentionConfig
from latentserve.forward_context import ForwardContext, set_forward_context
from latentserve.models import DeepseekForCausalLM


class PagedRunner:
    """Keeps each request's blocks and length; `step` runs one batch of new tokens and returns fp32 logits."""

    def __init__(self, model: DeepseekForCausalLM, attn_config: AttentionConfig, num_blocks: int = 48,
                 seed: int = 0, cache_dtype: torch.dtype = torch.float32) -> None:
        self.model = model
        self.block_size = attn_config.block_size
        caches = allocate_kv_caches(model.static_forward_context, num_blocks, self.block_size, cache_dtype)
        for cache in caches.values():  # a read of a slot nobody wrote poisons the output (int8: NaN scales)
            cache.fill_(-1 if cache.dtype == torch.int8 else float("nan"))
        self.builder = MLAMetadataBuilder(
            model.attention_layer_names, model.static_forward_context, attn_config
        )
        # Hand out blocks in a scrambled order so that no request's blocks are contiguous.
        self.free_blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.blocks: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def _slots(self, request: int, num_new: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.lens.get(request, 0)
        blocks = self.blocks.setdefault(request, [])
        while len(blocks) * self.block_size < start + num_new:
            blocks.append(self.free_blocks.pop())
        positions = torch.arange(start, start + num_new)
        table = torch.tensor(blocks)
        return positions, table[positions // self.block_size] * self.block_size + positions % self.block_size

    def step(self, batch: list[tuple[int, list[int]]], *extra: torch.Tensor, **kwargs) -> torch.Tensor:
        """batch: (request id, new token ids) in the order given (decodes first) -> logits [T, vocab]."""
        hidden = self.forward(batch, *extra, **kwargs)
        with torch.no_grad():
            return self.model.compute_logits(hidden)

    def forward(self, batch: list[tuple[int, list[int]]], *extra: torch.Tensor, **kwargs) -> torch.Tensor:
        """The model's output over the batch; `extra` per-token inputs and `kwargs` go to the model's forward."""
        ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
        for request, tokens in batch:
            pos, slot = self._slots(request, len(tokens))
            ids += tokens
            positions.append(pos)
            slots.append(slot)
            query_lens.append(len(tokens))
            seq_lens.append(self.lens.get(request, 0) + len(tokens))
        max_blocks = max(len(self.blocks[r]) for r, _ in batch)
        block_table = torch.zeros(len(batch), max_blocks, dtype=torch.int32)
        for row, (request, _) in enumerate(batch):
            block_table[row, : len(self.blocks[request])] = torch.tensor(self.blocks[request])
        common = CommonAttentionMetadata.from_lists(query_lens, seq_lens, block_table, torch.cat(slots))
        metadata = self.builder.build(common)
        context = ForwardContext({name: metadata for name in self.model.attention_layer_names})
        with torch.no_grad(), set_forward_context(context):
            hidden = self.model(torch.tensor(ids), torch.cat(positions), *extra, **kwargs)
        for request, tokens in batch:
            self.lens[request] = self.lens.get(request, 0) + len(tokens)
        return hidden
