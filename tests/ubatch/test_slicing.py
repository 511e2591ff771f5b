import pytest
import torch

from latentserve.attention.metadata import CommonAttentionMetadata
from latentserve.ubatch.slicing import UBatchSlice, should_ubatch, slice_common_metadata, split_ubatches


def _common(query_lens, seq_lens, block_size=4):
    nb = max(-(-s // block_size) for s in seq_lens)
    bt = torch.arange(len(seq_lens) * nb, dtype=torch.int32).view(len(seq_lens), nb)
    slots = []
    for r, (q, s) in enumerate(zip(query_lens, seq_lens)):
        pos = torch.arange(s - q, s)
        slots.append(bt[r, pos // block_size].long() * block_size + pos % block_size)
    return CommonAttentionMetadata.from_lists(query_lens, seq_lens, bt, torch.cat(slots))


def test_split_through_a_prefill_continues_over_its_head():
    common = _common([1, 1, 10], [5, 7, 10])  # 12 tokens, midpoint 6 inside request 2 (tokens 2..11)
    s0, s1 = split_ubatches(common, decode_threshold=1)
    assert s0 == UBatchSlice(slice(0, 3), slice(0, 6)) and s1 == UBatchSlice(slice(2, 3), slice(6, 12))
    m0, m1 = slice_common_metadata(common, s0), slice_common_metadata(common, s1)
    assert m0.query_lens_cpu.tolist() == [1, 1, 4] and m0.seq_lens_cpu.tolist() == [5, 7, 4]
    assert m1.query_lens_cpu.tolist() == [6] and m1.seq_lens_cpu.tolist() == [10]
    assert m1.num_computed_tokens_cpu.tolist() == [4]  # the tail's context is the head written by ubatch 0
    assert torch.equal(torch.cat([m0.slot_mapping, m1.slot_mapping]), common.slot_mapping)


def test_split_on_a_request_boundary():
    common = _common([3, 3], [3, 3])
    s0, s1 = split_ubatches(common, 1)
    assert s0 == UBatchSlice(slice(0, 1), slice(0, 3)) and s1 == UBatchSlice(slice(1, 2), slice(3, 6))


def test_split_moves_to_request_start_when_head_would_be_a_decode_behind_prefills():
    # request 1 has context 10 and 8 new tokens; the midpoint 7 leaves it a 1-token head behind a prefill
    common = _common([6, 8], [6, 18])
    s0, s1 = split_ubatches(common, 1)
    assert s0 == UBatchSlice(slice(0, 1), slice(0, 6)) and s1 == UBatchSlice(slice(1, 2), slice(6, 14))


def test_thresholds():
    decodes = _common([1] * 4, [5, 6, 7, 8])
    assert should_ubatch(decodes, 1, 4, 100) and not should_ubatch(decodes, 1, 5, 2)
    mixed = _common([1, 5], [5, 5])
    assert should_ubatch(mixed, 1, 100, 6) and not should_ubatch(mixed, 1, 2, 7)
    assert not should_ubatch(_common([1], [1]), 1, 1, 1)


def test_bad_slices_are_refused():
    common = _common([3, 3], [3, 3])
    with pytest.raises(ValueError, match="out of range"):
        slice_common_metadata(common, UBatchSlice(slice(0, 3), slice(0, 6)))
    with pytest.raises(ValueError, match="do not cover"):
        slice_common_metadata(common, UBatchSlice(slice(1, 2), slice(0, 6)))
    with pytest.raises(ValueError, match="cannot split"):
        split_ubatches(_common([1], [1]), 1)


def test_whole_requests_split_between_requests_nearest_the_midpoint():
    """Hybrid models: a request's linear-attention state has one owner per step, so no request is in both."""
    common = _common([3, 10, 2, 5], [3, 10, 2, 5])  # 20 tokens, midpoint 10, boundaries at 3, 13, 15
    common.state_slots_cpu = torch.tensor([7, 2, 5, 0])
    s0, s1 = split_ubatches(common, 1, whole_requests=True)
    assert (s0.request_slice, s0.token_slice) == (slice(0, 2), slice(0, 13))
    assert (s1.request_slice, s1.token_slice) == (slice(2, 4), slice(13, 20))
    assert slice_common_metadata(common, s0).state_slots_cpu.tolist() == [7, 2]
    assert slice_common_metadata(common, s1).state_slots_cpu.tolist() == [5, 0]
    assert split_ubatches(_common([9], [9]), 1, whole_requests=True) is None  # one request: nothing to split
