"""Metadata building: decode/prefill split, ordering, chunked-context plan."""
import dataclasses

import pytest
import torch

from latentserve.attention.builder import reorder_decodes_first
from latentserve.attention.metadata import CommonAttentionMetadata
from latentserve.config import AttentionConfig, MLAConfig
from tests.attention.mla_case import Request, make_batch, setup


def test_split_and_rebased_prefill_metadata():
    layer, builder, cache = setup(AttentionConfig(block_size=4), 64)
    batch = make_batch([Request(5, 1), Request(3, 1), Request(0, 4), Request(6, 3)], cache, 4)
    md = builder.build(batch.common)
    assert (md.num_decodes, md.num_decode_tokens, md.num_prefills) == (2, 2, 2)
    assert md.prefill.query_start_loc_cpu == [0, 4, 7]
    assert md.prefill.context_lens_cpu == [0, 6]
    assert md.decode.seq_lens.tolist() == [6, 4]
    assert md.prefill.backends is builder.prefill_backends


def test_unordered_batch_is_a_clear_error_and_reorder_fixes_it():
    layer, builder, cache = setup(AttentionConfig(block_size=4), 64)
    requests = [Request(0, 4), Request(5, 1)]
    batch = make_batch(requests, cache, 4)
    with pytest.raises(ValueError, match="not ordered decodes first"):
        builder.build(batch.common)
    order = reorder_decodes_first([r.query_len for r in requests], [r.seq_len for r in requests], 1)
    assert order == [1, 0]


def test_a_block_table_too_narrow_for_a_decode_is_refused():
    """Decode kernels read blocks straight from the table: a missing block would be read past its end."""
    layer, builder, cache = setup(AttentionConfig(block_size=4), 64)
    common = CommonAttentionMetadata.from_lists([1], [9], torch.tensor([[3, 5]], dtype=torch.int32),
                                                torch.tensor([20]))
    with pytest.raises(ValueError, match="a request of 9 tokens needs 3 blocks, but the block table has 2 columns"):
        builder.build(common)


def test_chunk_plan_is_bounded_by_workspace_and_covers_context():
    config = AttentionConfig(block_size=4, workspace_tokens=10)
    layer, builder, cache = setup(config, 64)
    batch = make_batch([Request(23, 2), Request(7, 3)], cache, 4)
    plan = builder.build(batch.common).prefill.chunked_context
    assert plan.chunk_size == 5
    assert all(s.numel() <= config.workspace_tokens for s in plan.slots)
    assert len(plan.slots) == 5
    # every context slot of every request is read exactly once, in position order per request
    bt = batch.common.block_table
    for r, ctx in enumerate([23, 7]):
        read = [s for slots, cu in zip(plan.slots, plan.cu_seq_lens_cpu) for s in slots[cu[r] : cu[r + 1]].tolist()]
        assert read == [int(bt[r, p // 4]) * 4 + p % 4 for p in range(ctx)], r


def test_a_chunk_larger_than_the_workspace_is_an_error():
    """A plan whose chunk is one token too large must fail, not let the gather grow past the workspace."""
    config = AttentionConfig(block_size=4, workspace_tokens=10)
    layer, builder, cache = setup(config, 64)
    builder.attn_config = dataclasses.replace(config, workspace_tokens=11)  # the planner's size, one too large
    batch = make_batch([Request(23, 2)], cache, 4)
    with pytest.raises(RuntimeError, match="context chunk 0 holds 11 tokens but the workspace holds 10"):
        builder.build(batch.common)


def test_workspace_smaller_than_prefill_count_is_refused():
    layer, builder, cache = setup(AttentionConfig(block_size=4, workspace_tokens=1), 64)
    batch = make_batch([Request(3, 2), Request(2, 2)], cache, 4)
    with pytest.raises(ValueError, match="workspace_tokens=1"):
        builder.build(batch.common)


@pytest.mark.parametrize(
    "kwargs,msg",
    [
        (dict(query_lens=[2], seq_lens=[1]), "query_len 2 and seq_len 1"),
        (dict(query_lens=[1, 1], seq_lens=[3]), "2 query lengths but 1"),
    ],
)
def test_common_metadata_validation(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        CommonAttentionMetadata.from_lists(
            kwargs["query_lens"], kwargs["seq_lens"], torch.zeros(len(kwargs["seq_lens"]), 1), torch.zeros(2)
        )


def test_bad_configs_are_named():
    with pytest.raises(ValueError, match="block_size"):
        AttentionConfig(block_size=0)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        MLAConfig(num_heads=2, kv_lora_rank=0, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4)


def test_layer_refuses_token_count_mismatch():
    from latentserve.forward_context import ForwardContext, set_forward_context

    layer, builder, cache = setup(AttentionConfig(block_size=4), 16)
    batch = make_batch([Request(0, 3)], cache, 4)
    md = builder.build(batch.common)
    q, c, k = batch.new_token_inputs()
    with set_forward_context(ForwardContext({layer.layer_name: md})):
        with pytest.raises(ValueError, match="got 2 tokens but the metadata describes 3"):
            layer(q[:2], c[:2], k[:2])
