"""Persistent input buffers against the scheduler's own list-built metadata, over steps that grow and shrink."""
import random

import torch

from latentserve.engine.input_buffers import InputBuffers
from latentserve.engine.scheduler_output import ScheduledRequest, SchedulerOutput


def _step(rng: random.Random, num_reqs: int, max_ctx: int, block_size: int = 4) -> SchedulerOutput:
    scheduled = []
    for _ in range(num_reqs):
        computed = rng.randrange(0, max_ctx)
        new = rng.choice([1, 1, 2, rng.randrange(1, 40)])
        blocks = rng.sample(range(1000), -(-(computed + new) // block_size))
        slots = [blocks[p // block_size] * block_size + p % block_size for p in range(computed, computed + new)]
        tokens = [rng.randrange(50_000) for _ in range(new)]
        scheduled.append(ScheduledRequest(None, computed, new, tokens, slots, blocks, do_sample=rng.random() < 0.8))
    return SchedulerOutput(scheduled, num_decodes=0)


def test_buffers_match_list_built_inputs_and_are_reused():
    rng = random.Random(0)
    buffers = InputBuffers()
    pointers = None
    # Big first, so later (smaller) steps must reuse the same memory; then a bigger one grows it.
    for num_reqs, max_ctx in [(20, 300), (3, 10), (7, 120), (1, 5), (12, 250), (40, 600)]:
        out = _step(rng, num_reqs, max_ctx)
        inputs = buffers.prepare(out)
        ref = out.common_attention_metadata()
        got = inputs.common
        for name in ("query_start_loc", "seq_lens", "slot_mapping", "query_start_loc_cpu", "seq_lens_cpu"):
            assert torch.equal(getattr(got, name), getattr(ref, name)), name
        assert torch.equal(got.block_table, ref.block_table)
        assert got.block_table.is_contiguous()
        assert (got.num_reqs, got.num_actual_tokens, got.max_query_len, got.max_seq_len) == (
            ref.num_reqs, ref.num_actual_tokens, ref.max_query_len, ref.max_seq_len)
        assert inputs.input_ids.tolist() == out.input_ids
        assert inputs.positions.tolist() == out.positions
        assert inputs.logits_indices.tolist() == out.logits_indices
        now = (inputs.input_ids.data_ptr(), got.block_table.data_ptr(), got.seq_lens.data_ptr())
        if pointers is not None and num_reqs <= 20:
            assert now == pointers
        pointers = now
