"""Splitting one step's batch into two ubatches at the token midpoint."""
from __future__ import annotations

from dataclasses import dataclass

from latentserve.attention.builder import is_decode
from latentserve.attention.metadata import CommonAttentionMetadata


@dataclass(frozen=True)
class UBatchSlice:
    """A ubatch: its requests and its tokens within the step's batch."""

    request_slice: slice
    token_slice: slice

    @property
    def num_tokens(self) -> int:
        return self.token_slice.stop - self.token_slice.start


def should_ubatch(
    common: CommonAttentionMetadata,
    decode_threshold: int,
    dbo_decode_token_threshold: int,
    dbo_prefill_token_threshold: int,
) -> bool:
    """DBO runs when the step has at least the threshold's tokens (decode-only and mixed batches differ)."""
    if common.num_actual_tokens < 2:
        return False
    query_lens = common.query_lens_cpu.tolist()
    context_lens = common.num_computed_tokens_cpu.tolist()
    decode_only = all(is_decode(q, c, decode_threshold) for q, c in zip(query_lens, context_lens))
    threshold = dbo_decode_token_threshold if decode_only else dbo_prefill_token_threshold
    return common.num_actual_tokens >= threshold


def split_ubatches(
    common: CommonAttentionMetadata, decode_threshold: int, whole_requests: bool = False
) -> list[UBatchSlice] | None:
    """Two slices at the token midpoint; a request across it is in both, its tail continuing over its head.

    When the head part of that request would look like a decode behind prefills (breaking the
    decodes-first order), the split moves to the request's start instead. With `whole_requests` (a hybrid model:
    a request's linear-attention state must have one owner in a step) the split always falls between requests,
    at the boundary nearest the midpoint; None where there is none (a single request).
    """
    num_tokens = common.num_actual_tokens
    if num_tokens < 2:
        raise ValueError(f"cannot split a batch of {num_tokens} tokens into two ubatches")
    qsl = common.query_start_loc_cpu.tolist()
    context_lens = common.num_computed_tokens_cpu.tolist()
    mid = num_tokens // 2
    if whole_requests:
        if common.num_reqs < 2:
            return None
        r = min(range(1, common.num_reqs), key=lambda i: abs(qsl[i] - mid))
        return [UBatchSlice(slice(0, r), slice(0, qsl[r])),
                UBatchSlice(slice(r, common.num_reqs), slice(qsl[r], num_tokens))]
    r = next(i for i in range(common.num_reqs) if qsl[i] <= mid < qsl[i + 1])
    if qsl[r] < mid:
        head = mid - qsl[r]
        head_is_decode = is_decode(head, context_lens[r], decode_threshold)
        prefill_before = any(
            not is_decode(qsl[i + 1] - qsl[i], context_lens[i], decode_threshold) for i in range(r)
        )
        if head_is_decode and prefill_before:
            mid = qsl[r]
    if qsl[r] == mid:
        return [UBatchSlice(slice(0, r), slice(0, mid)), UBatchSlice(slice(r, common.num_reqs), slice(mid, num_tokens))]
    return [UBatchSlice(slice(0, r + 1), slice(0, mid)), UBatchSlice(slice(r, common.num_reqs), slice(mid, num_tokens))]


def slice_common_metadata(common: CommonAttentionMetadata, ubatch_slice: UBatchSlice) -> CommonAttentionMetadata:
    """The metadata of one ubatch; a request cut by the slice keeps only its tokens inside it."""
    t0, t1 = ubatch_slice.token_slice.start, ubatch_slice.token_slice.stop
    r0, r1 = ubatch_slice.request_slice.start, ubatch_slice.request_slice.stop
    if not (0 <= t0 < t1 <= common.num_actual_tokens and 0 <= r0 < r1 <= common.num_reqs):
        raise ValueError(f"{ubatch_slice} is out of range for a batch of {common.num_reqs} requests")
    qsl = common.query_start_loc_cpu[r0 : r1 + 1].clamp(t0, t1)
    if int(qsl[0]) != t0 or int(qsl[-1]) != t1:
        raise ValueError(f"{ubatch_slice}: its requests do not cover its tokens")
    query_lens = qsl[1:] - qsl[:-1]
    # Tokens of a request after the slice's end are not part of this ubatch's sequence yet.
    cut_tail = (common.query_start_loc_cpu[r0 + 1 : r1 + 1] - t1).clamp(min=0)
    seq_lens = common.seq_lens_cpu[r0:r1] - cut_tail
    return CommonAttentionMetadata.from_lists(
        query_lens.tolist(),
        seq_lens.tolist(),
        common.block_table[r0:r1],
        common.slot_mapping[t0:t1],
        device=common.query_start_loc.device,
        state_slots=None if common.state_slots_cpu is None else common.state_slots_cpu[r0:r1].tolist(),
    )

