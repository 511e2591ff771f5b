import pytest

from latentserve.engine import block_manager as bm_module
from latentserve.engine.block_manager import BlockManager, hash_block_tokens
from latentserve.engine.request import Request
from latentserve.sampling_params import SamplingParams

BS = 4


def make_request(request_id, tokens):
    return Request(request_id, list(tokens), SamplingParams())


def run_prefill(bm, request):
    """Admit a request the way the scheduler does and pretend its whole prompt was computed."""
    hits, num_cached = bm.get_computed_blocks(request)
    assert bm.can_allocate(request, request.num_tokens - num_cached, hits)
    bm.allocate(request, request.num_tokens - num_cached, hits)
    request.num_computed_tokens = request.num_tokens
    bm.cache_blocks(request, request.num_computed_tokens)
    return hits, num_cached


def test_common_prefix_shares_blocks_and_ref_counts():
    bm = BlockManager(num_blocks=10, block_size=BS)
    a = make_request("a", range(10))  # blocks: [0..3] [4..7] [8 9]
    run_prefill(bm, a)
    assert len(a.block_ids) == 3 and bm.num_free_blocks == 7

    b = make_request("b", list(range(8)) + [50, 51, 52])
    hits, num_cached = run_prefill(bm, b)
    assert hits == a.block_ids[:2] and num_cached == 8
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert [bm.blocks[i].ref_cnt for i in b.block_ids] == [2, 2, 1]
    assert bm.num_free_blocks == 6

    bm.free(a)
    assert [bm.blocks[i].ref_cnt for i in b.block_ids] == [1, 1, 1]
    assert all(i not in bm.free_block_ids for i in b.block_ids)
    assert bm.num_free_blocks == 7
    assert bm.usage == pytest.approx(3 / 10)


def test_last_token_is_always_computed():
    bm = BlockManager(num_blocks=10, block_size=BS)
    run_prefill(bm, make_request("a", range(12)))
    # Same 8 tokens: a full match would leave nothing to compute, so only the first block counts.
    assert bm.get_computed_blocks(make_request("b", range(8)))[1] == 4
    assert bm.get_computed_blocks(make_request("c", range(9)))[1] == 8
    assert bm.get_computed_blocks(make_request("d", range(12)))[1] == 8


def test_cached_blocks_are_reused_after_free():
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = make_request("a", range(9))
    run_prefill(bm, a)
    cached = a.block_ids[:2]
    bm.free(a)
    assert bm.num_free_blocks == 6 and bm.usage == 0.0

    c = make_request("c", list(range(8)) + [99])
    hits, num_cached = bm.get_computed_blocks(c)
    assert hits == cached and num_cached == 8
    bm.allocate(c, 1, hits)
    assert c.block_ids[:2] == cached and [bm.blocks[i].ref_cnt for i in c.block_ids] == [1, 1, 1]
    assert bm.num_free_blocks == 3  # the two revived blocks left the free pool too


def test_only_computed_full_blocks_are_cached():
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = make_request("a", range(10))
    bm.allocate(a, 6)  # first chunk: 6 of 10 tokens
    a.num_computed_tokens = 6
    bm.cache_blocks(a, a.num_computed_tokens)
    assert bm.get_computed_blocks(make_request("b", range(10)))[1] == 4
    bm.allocate(a, 4)
    a.num_computed_tokens = 10
    bm.cache_blocks(a, a.num_computed_tokens)
    assert bm.get_computed_blocks(make_request("c", range(10)))[1] == 8


def test_eviction_takes_uncached_then_least_recently_freed():
    bm = BlockManager(num_blocks=6, block_size=BS)
    old = make_request("old", range(100, 108))  # 2 full blocks
    new = make_request("new", range(200, 208))
    for r in (old, new):
        run_prefill(bm, r)
    partial = make_request("partial", range(300, 306))  # 1 full + 1 partial block
    run_prefill(bm, partial)
    bm.free(old)
    bm.free(new)
    bm.free(partial)
    # Two blocks: the partial one (never cached) and the tail of "old" (freed earliest, tail first).
    filler = make_request("filler", range(500, 508))
    bm.allocate(filler, 8)
    assert bm.get_computed_blocks(make_request("q1", list(range(100, 108)) + [1]))[1] == 4
    assert bm.get_computed_blocks(make_request("q2", list(range(200, 208)) + [1]))[1] == 8
    assert bm.get_computed_blocks(make_request("q3", list(range(300, 304)) + [1]))[1] == 4
    # Exhaust the pool: every cached block goes.
    bm.allocate(make_request("filler2", range(600, 616)), 16)
    assert bm.num_free_blocks == 0 and bm.cached_block_ids == {}
    assert bm.get_computed_blocks(make_request("q4", list(range(200, 208)) + [1])) == ([], 0)


def test_pool_exhaustion_is_reported_without_side_effects():
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = make_request("a", range(9))
    assert not bm.can_allocate(a, 13)
    with pytest.raises(RuntimeError, match="not enough free KV blocks"):
        bm.allocate(a, 13)
    bm.allocate(a, 9)
    a.num_computed_tokens = 9
    assert not bm.append_slots(a, 4)
    assert len(a.block_ids) == 3 and bm.num_free_blocks == 0
    assert bm.append_slots(a, 3)  # fits in the last block
    assert len(a.block_ids) == 3


def test_hash_chain_distinguishes_same_block_after_different_prefix():
    assert hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 4]), [5, 6, 7, 8]) != hash_block_tokens(
        hash_block_tokens(None, [9, 9, 9, 9]), [5, 6, 7, 8]
    )
    bm = BlockManager(num_blocks=10, block_size=BS)
    run_prefill(bm, make_request("xy", [1, 2, 3, 4, 5, 6, 7, 8, 0]))
    run_prefill(bm, make_request("z", [9, 9, 9, 9, 0]))
    # First block matches "z", second block's tokens match "xy"'s second block, but after another prefix.
    hits, num_cached = bm.get_computed_blocks(make_request("zy", [9, 9, 9, 9, 5, 6, 7, 8, 0]))
    assert num_cached == 4 and len(hits) == 1


def test_hash_collision_is_not_a_hit(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block_tokens", lambda parent, tokens: 42)
    bm = BlockManager(num_blocks=10, block_size=BS)
    run_prefill(bm, make_request("a", [1, 2, 3, 4, 0]))
    assert bm.get_computed_blocks(make_request("b", [5, 6, 7, 8, 0])) == ([], 0)


def test_prefix_caching_can_be_disabled():
    bm = BlockManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    run_prefill(bm, make_request("a", range(9)))
    assert bm.get_computed_blocks(make_request("b", range(9))) == ([], 0)
    assert bm.cached_block_ids == {}


@pytest.mark.parametrize("kwargs", [{"num_blocks": 0, "block_size": 4}, {"num_blocks": 4, "block_size": 0}])
def test_bad_sizes(kwargs):
    with pytest.raises(ValueError, match="must be positive"):
        BlockManager(**kwargs)


def test_blocks_a_step_will_write_are_shared_then_committed_or_discarded():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_request("a", range(10))
    bm.allocate(a, 10)
    bm.cache_blocks(a, 10)  # as scheduled: its step is to write 10 tokens, 2 full blocks
    assert all(bm.is_pending(b) for b in a.block_ids[:2]) and not bm.is_pending(a.block_ids[2])
    hits, num_cached = bm.get_computed_blocks(make_request("b", range(9)))
    assert hits == a.block_ids[:2] and num_cached == 8  # a request later in the same step may share them
    bm.commit_step()
    assert not any(bm.is_pending(b) for b in a.block_ids)
    assert bm.get_computed_blocks(make_request("c", range(9)))[1] == 8

    d = make_request("d", range(50, 60))
    bm.allocate(d, 10)
    bm.cache_blocks(d, 10)
    bm.discard_step()  # d's step failed: its blocks hold nothing
    assert bm.get_computed_blocks(make_request("e", range(50, 60)))[1] == 0
    assert bm.get_computed_blocks(make_request("f", range(9)))[1] == 8  # committed blocks stay
