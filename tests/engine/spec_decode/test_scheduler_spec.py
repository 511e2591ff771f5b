"""The scheduler's and block manager's bookkeeping under speculative decoding, step by step with made-up drafts:
computed tokens after partial and full acceptance (accepted drafts' KV is kept, rejected drafts' rolled back), what
the next step schedules, draft slots kept out of the prefix cache, and cache hits on speculatively generated text."""
from __future__ import annotations

from latentserve.engine.block_manager import BlockManager
from latentserve.engine.request import Request
from latentserve.engine.scheduler import Scheduler, SchedulerConfig
from latentserve.sampling_params import SamplingParams

K = 3
BLOCK = 4


def make_scheduler() -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=64, max_model_len=128, decode_threshold=K + 1,
                             num_speculative_tokens=K)
    return Scheduler(config, BlockManager(num_blocks=32, block_size=BLOCK))


def step(scheduler: Scheduler, sampled: int, accepted: list[int] | None = None, drafts: list[int] | None = None):
    """Schedule one step of the single running request; it accepts `accepted`, samples `sampled`, drafts `drafts`."""
    out = scheduler.schedule()
    (s,) = out.scheduled
    scheduler.update(out, [sampled], accepted_draft_ids=[accepted or []],
                     spec_token_ids={s.request.request_id: drafts or []})
    return s


def start(scheduler: Scheduler, prompt: list[int], drafts: list[int]) -> Request:
    request = Request("a", prompt, SamplingParams(temperature=0.0, max_tokens=50))
    scheduler.add_request(request)
    prefill = step(scheduler, sampled=900, drafts=drafts)
    assert prefill.num_new_tokens == len(prompt) and prefill.spec_token_ids == []
    assert request.num_computed_tokens == len(prompt) and request.output_token_ids == [900]
    return request


def test_partial_then_full_acceptance_keeps_the_accepted_drafts_kv():
    scheduler = make_scheduler()
    prompt = list(range(10, 16))
    request = start(scheduler, prompt, drafts=[901, 902, 903])

    # Verify 900 and its three drafts; the first draft is accepted, then 950 is sampled.
    verify = step(scheduler, sampled=950, accepted=[901], drafts=[951, 952, 953])
    assert (verify.num_computed_tokens, verify.token_ids, verify.spec_token_ids) == (6, [900, 901, 902, 903],
                                                                                      [901, 902, 903])
    assert request.output_token_ids == [900, 901, 950]
    # 900 and the accepted 901 have their KV; the rejected 902 and 903 are rolled back.
    assert request.num_computed_tokens == 8 == request.num_tokens - 1

    # Next: 950 (its KV at position 8, over 902's stale slot) and its drafts; all three are accepted.
    verify = step(scheduler, sampled=990, accepted=[951, 952, 953], drafts=[991])
    assert (verify.num_computed_tokens, verify.token_ids) == (8, [950, 951, 952, 953])
    assert request.output_token_ids == [900, 901, 950, 951, 952, 953, 990]
    assert request.num_computed_tokens == 12 == request.num_tokens - 1  # no accepted draft is computed again

    after = step(scheduler, sampled=7)
    assert (after.num_computed_tokens, after.token_ids) == (12, [990, 991])


def test_draft_slots_stay_out_of_the_prefix_cache_and_accepted_text_is_cached():
    scheduler = make_scheduler()
    bm = scheduler.block_manager
    prompt = list(range(10, 15))  # 5 tokens: 900 and two drafts fill the second block
    request = start(scheduler, prompt, drafts=[901, 902, 903])

    verify = step(scheduler, sampled=950, accepted=[901, 902], drafts=[951])
    assert verify.token_ids == [900, 901, 902, 903]
    # While 901 and 902 were only drafts, their block (positions 4-7) was not offered to the cache.
    assert request.num_computed_tokens == 8
    second = bm.blocks[request.block_ids[1]]
    assert second.block_hash is None

    step(scheduler, sampled=960, accepted=[951])  # schedules 950: the second block is now verified text
    assert second.token_ids == (14, 900, 901, 902)

    # A new request whose prompt starts with that text hits both blocks, the speculated one included.
    text = prompt + [900, 901, 902, 950, 951]
    follower = Request("b", text[:8] + [1, 2], SamplingParams(max_tokens=1))
    blocks, num_cached = bm.get_computed_blocks(follower)
    assert (blocks, num_cached) == (request.block_ids[:2], 8)
