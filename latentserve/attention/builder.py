"""`MLAMetadataBuilder`: CommonAttentionMetadata -> MLAMetadata, one builder per ubatch."""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from latentserve import batch_invariant
from latentserve.attention.dsa.metadata import DSAMetadataBuilder
from latentserve.attention.kv_cache import slots_for_positions
from latentserve.attention.metadata import (
    ChunkedContextMetadata,
    CommonAttentionMetadata,
    MLADecodeMetadata,
    MLAMetadata,
    MLAPrefillMetadata,
    StateMetadata,
)
from latentserve.attention.prefill.base import MLAPrefillBackend
from latentserve.config import AttentionConfig, kv_cache_row_width


def is_decode(query_len: int, context_len: int, decode_threshold: int) -> bool:
    """Decodes are requests with a few new tokens over some cached context."""
    return 0 < query_len <= decode_threshold and context_len > 0


def reorder_decodes_first(query_lens: list[int], seq_lens: list[int], decode_threshold: int) -> list[int]:
    """A stable permutation of request indices that puts decodes before prefills."""
    kinds = [is_decode(q, s - q, decode_threshold) for q, s in zip(query_lens, seq_lens)]
    return [i for i, d in enumerate(kinds) if d] + [i for i, d in enumerate(kinds) if not d]


def count_decodes(query_lens: list[int], context_lens: list[int], decode_threshold: int) -> int:
    """Number of leading decode requests; raises if a decode follows a prefill."""
    num_decodes = 0
    for i, (q, c) in enumerate(zip(query_lens, context_lens)):
        if q == 0:
            raise ValueError(f"request {i} has no new tokens in this batch")
        if is_decode(q, c, decode_threshold):
            if num_decodes != i:
                raise ValueError(
                    f"batch is not ordered decodes first: request {i} is a decode after a prefill; "
                    "order it with reorder_decodes_first()"
                )
            num_decodes += 1
    return num_decodes


class MLAMetadataBuilder:
    """Builds the MLA metadata of one ubatch and owns the prefill backend instances it prepares (one per distinct
    layer shape)."""

    def __init__(
        self,
        layer_names: list[str],
        static_ctx: Mapping[str, object],
        attn_config: AttentionConfig,
        device: torch.device | str = "cpu",
        builder_id: int = 0,
        state_layer_names: Sequence[str] = (),
    ) -> None:
        if not layer_names:
            raise ValueError("MLAMetadataBuilder needs at least one attention layer name")
        missing = [n for n in layer_names if n not in static_ctx]
        if missing:
            raise ValueError(f"attention layers {missing} are not in the static forward context")
        self.layer_names = list(layer_names)
        # A hybrid model's linear-attention layers read this builder's metadata too (its `states`).
        self.state_layer_names = list(state_layer_names)
        self.attn_config = attn_config
        self.device = torch.device(device)
        self.builder_id = builder_id
        layers = [static_ctx[n] for n in layer_names]
        # The seed's fix: prepare_metadata() stores per-batch state on the backend, so each builder (one per
        # ubatch) prepares and runs its own instances, never the layers' shared ones. Layers may differ in shape
        # (heads, ranks, head dims, scale): each distinct backend setting gets its own clone.
        clones: dict[tuple, MLAPrefillBackend] = {}
        self.prefill_backends: dict[str, MLAPrefillBackend] = {}
        for name, layer in zip(layer_names, layers):
            key = layer.prefill_backend.settings_key()
            if key not in clones:
                clones[key] = layer.prefill_backend.clone()
                clones[key].claim(self)
            self.prefill_backends[name] = clones[key]
        dtypes = {layer.kv_cache_dtype for layer in layers}
        if len(dtypes) > 1:
            raise ValueError(f"the attention layers cache in different dtypes {sorted(map(str, dtypes))}: one "
                             "builder's context workspace holds one dtype")
        # One workspace for every layer: each gathers into it as rows of its own cache width (gather_kv_cache).
        dtype = dtypes.pop()
        width = kv_cache_row_width(max(layer.mla.kv_cache_dim for layer in layers), dtype)
        self.workspace = torch.empty(attn_config.workspace_tokens, width, dtype=dtype, device=self.device)
        # The DSA top-k state is per-batch state too: this builder's own, like the backend clone and workspace.
        topks = {layer.index_topk for layer in layers} - {None}
        if len(topks) > 1:
            raise ValueError(f"the attention layers select different top-k counts {sorted(topks)}: one builder "
                             "builds one DSA selection per ubatch")
        sinks = any(getattr(layer, "sinks", None) is not None for layer in layers)
        self.dsa = None if not topks else DSAMetadataBuilder(
            topks.pop(), attn_config.block_size, self.workspace, attn_config.debug_ownership, self, always_sparse=sinks)

    def __repr__(self) -> str:
        return f"MLAMetadataBuilder(id={self.builder_id})"

    def build(self, common: CommonAttentionMetadata) -> MLAMetadata:
        # The batch's lengths as host lists, read once: a step's planning is a few list operations, no tensor ops.
        qsl = common.query_start_loc_cpu.tolist()
        seq_lens = common.seq_lens_cpu.tolist()
        query_lens = [end - start for start, end in zip(qsl, qsl[1:])]
        context_lens = [s - q for s, q in zip(seq_lens, query_lens)]
        num_decodes = count_decodes(query_lens, context_lens, self.attn_config.decode_threshold)
        if batch_invariant.is_enabled():
            # Every token on the decode path: its attention then reads its cache rows in the same fixed chunks
            # however its prompt was split into steps or shared with a prefix-cache hit.
            num_decodes = common.num_reqs
        num_decode_tokens = qsl[num_decodes]
        num_prefills = common.num_reqs - num_decodes
        decode = (self._build_decode(common, num_decodes, max(query_lens[:num_decodes]), max(seq_lens[:num_decodes]))
                  if num_decodes else None)
        prefill = self._build_prefill(common, num_decodes) if num_prefills else None
        if prefill is not None:
            for backend in set(self.prefill_backends.values()):
                backend.prepare_metadata(prefill)
        return MLAMetadata(
            num_actual_tokens=common.num_actual_tokens,
            slot_mapping=common.slot_mapping,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            num_prefills=num_prefills,
            decode=decode,
            prefill=prefill,
            builder_id=self.builder_id,
            dsa=None if self.dsa is None else self.dsa.build(common),
            states=None if common.state_slots_cpu is None else StateMetadata(
                qsl, context_lens, common.state_slots_cpu.tolist()),
        )

    def _build_decode(self, common: CommonAttentionMetadata, num_decodes: int, max_query_len: int,
                      max_seq_len: int) -> MLADecodeMetadata:
        # Decode kernels read blocks straight from the table: a table too narrow for a request would be read past.
        if common.block_table.shape[1] * self.attn_config.block_size < max_seq_len:
            raise ValueError(f"decode metadata: a request of {max_seq_len} tokens needs "
                             f"{-(-max_seq_len // self.attn_config.block_size)} blocks, but the block table has "
                             f"{common.block_table.shape[1]} columns")
        return MLADecodeMetadata(
            block_table=common.block_table[:num_decodes],
            seq_lens=common.seq_lens[:num_decodes],
            query_start_loc=common.query_start_loc[: num_decodes + 1],
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
        )

    def _build_prefill(self, common: CommonAttentionMetadata, num_decodes: int) -> MLAPrefillMetadata:
        qsl_cpu = common.query_start_loc_cpu[num_decodes:] - common.query_start_loc_cpu[num_decodes]
        context_lens = common.num_computed_tokens_cpu[num_decodes:].tolist()
        query_lens = (qsl_cpu[1:] - qsl_cpu[:-1]).tolist()
        chunked = None
        if any(context_lens):
            chunked = self._plan_context_chunks(common.block_table[num_decodes:], context_lens)
        return MLAPrefillMetadata(
            query_start_loc=qsl_cpu.to(self.device),
            query_start_loc_cpu=qsl_cpu.tolist(),
            context_lens_cpu=context_lens,
            max_query_len=max(query_lens),
            chunked_context=chunked,
            backends=self.prefill_backends,
        )

    def _plan_context_chunks(self, block_table: torch.Tensor, context_lens: list[int]) -> ChunkedContextMetadata:
        """Split every prefill's context into chunks so that one chunk of all of them fits the workspace."""
        num_prefills = len(context_lens)
        chunk_size = self.attn_config.workspace_tokens // num_prefills
        if chunk_size == 0:
            raise ValueError(
                f"workspace_tokens={self.attn_config.workspace_tokens} is smaller than the {num_prefills} "
                "prefill requests in this batch; raise it to at least max_num_seqs"
            )
        num_chunks = -(-max(context_lens) // chunk_size)
        block_size = self.attn_config.block_size
        bt_cpu = block_table.cpu()
        slots, cu_seq_lens, cu_cpu = [], [], []
        for c in range(num_chunks):
            start = c * chunk_size
            lens = [max(0, min(chunk_size, ctx - start)) for ctx in context_lens]
            chunk_slots = [
                slots_for_positions(bt_cpu[r], torch.arange(start, start + n), block_size)
                for r, n in enumerate(lens)
                if n
            ]
            cu = [0]
            for n in lens:
                cu.append(cu[-1] + n)
            if cu[-1] > self.workspace.shape[0]:
                # index_select(out=) would silently grow past the workspace instead of failing.
                raise RuntimeError(
                    f"context chunk {c} holds {cu[-1]} tokens but the workspace holds {self.workspace.shape[0]}"
                )
            slots.append(torch.cat(chunk_slots).to(self.device))
            cu_seq_lens.append(torch.tensor(cu, dtype=torch.int32, device=self.device))
            cu_cpu.append(cu)
        return ChunkedContextMetadata(
            chunk_size=chunk_size, slots=slots, cu_seq_lens=cu_seq_lens, cu_seq_lens_cpu=cu_cpu, workspace=self.workspace
        )
