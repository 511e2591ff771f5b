import pytest
import torch

from latentserve.engine.block_manager import BlockManager
from latentserve.engine.detokenizer import IncrementalDetokenizer
from latentserve.engine.request import Logprobs, Request, RequestStatus
from latentserve.engine.scheduler import Scheduler, SchedulerConfig
from latentserve.sampling_params import SamplingParams

VOCAB = 1000


def fake_token(request):
    """A deterministic 'model': the next token depends only on the sequence so far."""
    return (sum(request.all_token_ids) * 31 + request.num_tokens) % VOCAB + 2


class FakeKVCache:
    """Records, for each written slot, which token prefix its KV would encode, and checks every read."""

    def __init__(self, block_size):
        self.block_size = block_size
        self.slots = {}

    def run(self, out, block_manager):
        """One step as the model runs it: every layer writes the step's tokens, then attends."""
        written = {}  # slot -> (prefix hash, index in the batch of the request writing it)
        for i, s in enumerate(out.scheduled):
            tokens = s.request.all_token_ids
            assert s.token_ids == tokens[s.num_computed_tokens : s.seq_len]
            for p, slot in zip(s.positions, s.slot_mapping):
                block_id = slot // self.block_size
                # Never write into a block another request holds, unless it shares it from this very step.
                assert block_manager.blocks[block_id].ref_cnt == 1 or block_manager.is_pending(block_id)
                assert slot not in written, "two tokens written to one slot"
                written[slot] = (hash(tuple(tokens[: p + 1])), i)
        for i, s in enumerate(out.scheduled):
            tokens = s.request.all_token_ids
            for p in range(s.num_computed_tokens):  # the context this step attends to
                slot = s.block_ids[p // self.block_size] * self.block_size + p % self.block_size
                if slot in written:
                    # Shared from this step: its writer must come first, and the reader be a prefill (decodes run
                    # first, and under DBO in the earlier ubatch).
                    value, writer = written[slot]
                    assert writer < i and i >= out.num_decodes, f"{s.request} reads KV its step has not written"
                else:
                    value = self.slots.get(slot)
                assert value == hash(tuple(tokens[: p + 1])), f"stale KV at position {p} of {s.request}"
        self.slots.update({slot: value for slot, (value, _) in written.items()})


def drive(scheduler, arrivals=None, max_steps=1000, check=None):
    """Run steps with the fake model until no request is left; arrivals: step -> requests to add."""
    arrivals = dict(arrivals or {})
    kv = scheduler.fake_kv
    steps = []
    for step in range(max_steps):
        for request in arrivals.pop(step, []):
            scheduler.add_request(request)
        if not scheduler.has_unfinished_requests() and not arrivals:
            return steps
        out = scheduler.schedule()
        kv.run(out, scheduler.block_manager)
        if check is not None:
            check(out)
        steps.append(out)
        scheduler.update(out, [fake_token(r) for r in out.sampling_requests])
    raise AssertionError("scheduler did not finish: deadlock or livelock")


def make_scheduler(num_blocks=64, block_size=4, **config):
    config.setdefault("max_num_batched_tokens", 32)
    config.setdefault("max_model_len", 256)
    scheduler = Scheduler(SchedulerConfig(**config), BlockManager(num_blocks, block_size))
    scheduler.fake_kv = FakeKVCache(block_size)  # outlives one drive(): cached blocks stay checked
    return scheduler


def make_request(request_id, prompt_len, max_tokens=8, first=1, **params):
    prompt = [(first + 7 * i) % VOCAB + 2 for i in range(prompt_len)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params))


def reference_outputs(requests):
    """Each request alone with an unlimited pool and budget: what the fake model would produce."""
    result = {}
    for r in requests:
        alone = Request(r.request_id, r.prompt_token_ids, r.sampling_params)
        while alone.num_output_tokens < r.sampling_params.max_tokens:
            alone.all_token_ids.append(fake_token(alone))
            alone.output_token_ids.append(alone.all_token_ids[-1])
        result[r.request_id] = alone.output_token_ids
    return result


def test_continuous_batching_respects_limits_and_finishes_everything():
    scheduler = make_scheduler(max_num_batched_tokens=24, max_num_seqs=3)
    arrivals = {0: [make_request("a", 30), make_request("b", 5, max_tokens=12)], 3: [make_request("c", 9, first=4)],
                6: [make_request("d", 2, max_tokens=20, first=9), make_request("e", 17, first=5)]}
    requests = [r for rs in arrivals.values() for r in rs]

    def check(out):
        assert out.num_scheduled_tokens <= 24
        assert len(out.scheduled) <= 3 and len(scheduler.running) <= 3
        flags = [s.num_computed_tokens > 0 and s.num_new_tokens <= 1 for s in out.scheduled]
        assert flags == sorted(flags, reverse=True) and sum(flags) == out.num_decodes

    steps = drive(scheduler, arrivals, check=check)
    assert all(r.status == RequestStatus.FINISHED_LENGTH and r.finish_reason == "length" for r in requests)
    assert {r.request_id: r.output_token_ids for r in requests} == reference_outputs(requests)
    # Batching is continuous: some step mixes decodes with prefills of requests that arrived later.
    assert any(0 < out.num_decodes < len(out.scheduled) for out in steps)
    assert scheduler.block_manager.usage == 0.0


def test_chunked_prefill_of_long_prompt():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    request = make_request("long", 50, max_tokens=3)
    steps = drive(scheduler, {0: [request]})
    chunks = [(out.scheduled[0].num_computed_tokens, out.scheduled[0].num_new_tokens, out.scheduled[0].do_sample) for out in steps]
    assert chunks == [(0, 16, False), (16, 16, False), (32, 16, False), (48, 2, True), (50, 1, True), (51, 1, True)]
    assert request.num_output_tokens == 3


def test_chunked_prefill_can_be_disabled():
    scheduler = make_scheduler(max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False)
    a, b = make_request("a", 40, max_tokens=2), make_request("b", 40, max_tokens=2, first=100)
    steps = drive(scheduler, {0: [a, b]})
    assert [[s.num_new_tokens for s in out.scheduled] for out in steps][:2] == [[40], [1, 40]]
    with pytest.raises(ValueError, match="without chunked prefill"):
        SchedulerConfig(max_num_batched_tokens=16, max_model_len=64, enable_chunked_prefill=False)


def test_decodes_come_first_even_when_admitted_later():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    drive(scheduler, {0: [make_request("warm", 8, max_tokens=1)]})  # caches two blocks
    long = make_request("long", 20, first=500)
    scheduler.add_request(long)
    scheduler.update(first := scheduler.schedule(), [])
    assert [(s.request.request_id, s.num_new_tokens) for s in first.scheduled] == [("long", 16)]
    # Same 8 tokens as "warm" plus one: a prefix hit leaves a single new token after cached context.
    hit = Request("hit", make_request("x", 8).prompt_token_ids + [3], SamplingParams())
    scheduler.add_request(hit)
    out = scheduler.schedule()
    assert [(s.request.request_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled] == [
        ("hit", 8, 1),
        ("long", 16, 4),
    ]
    assert out.num_decodes == 1 and hit.num_cached_tokens == 8
    assert scheduler.running == [long, hit]  # batch order, not queue order, changed


def test_prefix_cache_hits_skip_computation():
    scheduler = make_scheduler()
    first = make_request("first", 18)
    drive(scheduler, {0: [first]})
    again = make_request("again", 18, max_tokens=4)
    steps = drive(scheduler, {0: [again]})
    assert again.num_cached_tokens == 16 and steps[0].scheduled[0].num_new_tokens == 2
    assert again.output_token_ids == first.output_token_ids[:4]


def test_preemption_under_tiny_pool_still_finishes_every_request():
    # 8 blocks of 4 tokens; each request ends at 6 + 10 = 16 tokens (4 blocks), so four cannot run at once.
    scheduler = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=32)
    requests = [make_request(f"r{i}", 6, max_tokens=10, first=i * 50) for i in range(4)]
    steps = drive(scheduler, {0: requests})
    assert any(out.preempted for out in steps)
    assert any(r.num_preemptions > 0 for r in requests)
    assert {r.request_id: r.output_token_ids for r in requests} == reference_outputs(requests)
    assert all(r.finish_reason == "length" for r in requests)
    assert scheduler.block_manager.num_free_blocks == 8


def test_preempted_request_recomputes_its_outputs():
    scheduler = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64)
    a, b = make_request("a", 7, max_tokens=8), make_request("b", 7, max_tokens=8, first=300)
    recomputes = []

    def check(out):
        for s in out.scheduled:
            if s.num_new_tokens > 1 and s.request.num_output_tokens > 0:
                recomputes.append((s.seq_len, s.request.num_tokens, s.do_sample))

    drive(scheduler, {0: [a, b]}, check=check)
    assert a.num_preemptions + b.num_preemptions > 0
    # The recompute covers prompt and outputs, then samples the next token.
    assert recomputes and all(seq_len == total and do_sample for seq_len, total, do_sample in recomputes)
    assert a.num_output_tokens == b.num_output_tokens == 8


def test_request_that_can_never_fit_is_rejected_and_others_finish():
    scheduler = make_scheduler(num_blocks=4, block_size=4)  # 16 tokens in all
    too_long = make_request("too_long", 20)
    grows_too_long = make_request("grows", 10, max_tokens=20, first=200)
    fine = make_request("fine", 5, max_tokens=4, first=400)
    steps = drive(scheduler, {0: [too_long, fine], 2: [grows_too_long]})
    assert too_long.status == RequestStatus.FINISHED_ERROR and too_long.finish_reason == "error"
    assert "needs 5 KV blocks for 20 tokens" in too_long.error and "only 4 blocks of 4 tokens" in too_long.error
    assert too_long.num_output_tokens == 0 and too_long in steps[0].finished
    assert fine.finish_reason == "length" and fine.num_output_tokens == 4
    # The growing one keeps what it generated until the pool cannot hold its next token.
    assert grows_too_long.finish_reason == "error" and grows_too_long.num_output_tokens == 16 - 10 + 1
    assert scheduler.block_manager.num_free_blocks == 4


def test_prompt_longer_than_max_model_len_is_refused():
    scheduler = make_scheduler(max_model_len=16)
    with pytest.raises(ValueError, match="longer than max_model_len=16"):
        scheduler.add_request(make_request("big", 17))
    scheduler.add_request(make_request("ok", 3))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add_request(make_request("ok", 3))


def _run_one(scheduler, request, tokens):
    """Feed a fixed token sequence as the model's samples."""
    scheduler.add_request(request)
    tokens = iter(tokens)
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        scheduler.update(out, [next(tokens) for _ in out.sampling_requests])


def test_stop_conditions():
    eos = 1
    scheduler = make_scheduler()

    r = make_request("eos", 3, max_tokens=10)
    r.eos_token_id = eos
    _run_one(scheduler, r, [5, 6, eos, 7, 8])
    assert r.output_token_ids == [5, 6, eos] and r.finish_reason == "stop" and r.stop_reason is None

    r = make_request("ignore", 3, max_tokens=4, ignore_eos=True)
    r.eos_token_id = eos
    _run_one(scheduler, r, [5, eos, 6, eos, 7])
    assert r.output_token_ids == [5, eos, 6, eos] and r.finish_reason == "length"

    r = make_request("stop_id", 3, max_tokens=10, stop_token_ids=[9, 8])
    _run_one(scheduler, r, [5, 8, 9])
    assert r.output_token_ids == [5, 8] and r.finish_reason == "stop" and r.stop_reason == 8

    r = make_request("min", 3, max_tokens=10, min_tokens=3, stop_token_ids=[9])
    r.eos_token_id = eos
    _run_one(scheduler, r, [eos, 9, 9, 5])
    assert r.output_token_ids == [eos, 9, 9] and r.stop_reason == 9
    assert r.banned_token_ids() == []

    small = make_scheduler(max_model_len=8)
    r = make_request("model_len", 5, max_tokens=None)
    _run_one(small, r, [5, 6, 7, 8])
    assert r.num_tokens == 8 and r.output_token_ids == [5, 6, 7] and r.finish_reason == "length"


def test_stop_string_via_detokenizer(tiny_tokenizer):
    scheduler = make_scheduler()
    prompt = tiny_tokenizer.encode("hello").ids
    text = " world, the end. stop here. then go on"
    params = SamplingParams(max_tokens=100, stop=["stop here", "then"])
    r = Request("s", prompt, params, detokenizer=IncrementalDetokenizer(tiny_tokenizer, prompt, stop=params.stop))
    _run_one(scheduler, r, tiny_tokenizer.encode(text).ids)
    assert r.finish_reason == "stop" and r.stop_reason == "stop here"
    assert r.detokenizer.output_text == " world, the end. "
    assert scheduler.block_manager.usage == 0.0

    with pytest.raises(ValueError, match="no detokenizer"):
        scheduler.add_request(make_request("nodetok", 3, stop=["x"]))


def test_abort_waiting_and_running():
    scheduler = make_scheduler(max_num_seqs=1)
    a, b = make_request("a", 6), make_request("b", 6)
    scheduler.add_request(a)
    scheduler.add_request(b)
    out = scheduler.schedule()
    assert scheduler.abort_request("b") is b and b.finish_reason == "abort"
    assert scheduler.abort_request("a") is a
    assert scheduler.abort_request("a") is None and scheduler.abort_request("nope") is None
    assert scheduler.update(out, [7]) == []  # a's result arrives after the abort and is dropped
    assert a.output_token_ids == [] and not scheduler.has_unfinished_requests()
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks


def test_prompt_logprobs_accumulate_across_chunks():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    drive(scheduler, {0: [make_request("warm", 20, max_tokens=1)]})
    r = make_request("p", 20, max_tokens=1, prompt_logprobs=0)
    scheduler.add_request(r)
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        s = out.scheduled[0]
        targets = r.prompt_logprob_targets(s.num_computed_tokens, s.num_new_tokens)
        entries = [Logprobs(t, -float(s.num_computed_tokens + 1 + i), 1, []) for i, t in enumerate(targets)]
        scheduler.update(out, [5] if s.do_sample else [], [None] if s.do_sample else None, {"p": entries})
    assert r.num_cached_tokens == 0  # prompt logprobs need every position: no cache hit
    assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == 20
    assert [(e.token_id, e.logprob) for e in r.prompt_logprobs[1:]] == [(t, -float(i)) for i, t in enumerate(r.prompt_token_ids) if i > 0]


def test_scheduler_output_builds_attention_metadata():
    scheduler = make_scheduler(max_num_batched_tokens=12)
    scheduler.add_request(make_request("a", 5, max_tokens=3))
    scheduler.update(scheduler.schedule(), [11])
    scheduler.add_request(make_request("b", 14, first=9))
    out = scheduler.schedule()
    assert out.query_lens == [1, 11] and out.seq_lens == [6, 11] and out.num_decodes == 1
    assert out.logits_indices == [0] and [r.request_id for r in out.sampling_requests] == ["a"]
    meta = out.common_attention_metadata()
    assert meta.query_start_loc.tolist() == [0, 1, 12] and meta.num_actual_tokens == 12
    assert meta.block_table.shape == (2, 3) and meta.block_table[0, 2] == 0
    assert meta.slot_mapping.tolist() == out.slot_mapping
    bs = scheduler.block_manager.block_size
    expected = [out.scheduled[i].block_ids[p // bs] * bs + p % bs for i, s in enumerate(out.scheduled) for p in s.positions]
    assert out.slot_mapping == expected and out.positions == [5] + list(range(11))
    assert out.input_ids == out.scheduled[0].request.all_token_ids[5:6] + out.scheduled[1].request.all_token_ids[:11]
    assert torch.equal(meta.seq_lens_cpu, torch.tensor([6, 11], dtype=torch.int32))


def test_update_checks_sample_count():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 3))
    out = scheduler.schedule()
    with pytest.raises(ValueError, match="0 sampled tokens for 1 sampling requests"):
        scheduler.update(out, [])


@pytest.mark.parametrize("seed", range(5))
def test_random_workload_invariants(seed):
    gen = torch.Generator().manual_seed(seed)

    def rand(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=gen))

    scheduler = make_scheduler(num_blocks=rand(6, 14), block_size=rand(2, 5), max_num_batched_tokens=rand(8, 40),
                               max_num_seqs=rand(2, 6), max_model_len=64)
    shared = [rand(2, VOCAB) for _ in range(12)]
    arrivals = {}
    requests = []
    for i in range(12):
        prompt = (shared[: rand(0, 12)] + [rand(2, VOCAB) for _ in range(rand(1, 20))])[:40]
        r = Request(f"r{i}", prompt, SamplingParams(max_tokens=rand(1, 12)))
        requests.append(r)
        arrivals.setdefault(rand(0, 15), []).append(r)

    def check(out):
        assert out.num_scheduled_tokens <= scheduler.config.max_num_batched_tokens
        assert len(scheduler.running) <= scheduler.config.max_num_seqs
        flags = [s.num_computed_tokens > 0 and s.num_new_tokens <= 1 for s in out.scheduled]
        assert flags == sorted(flags, reverse=True)

    drive(scheduler, arrivals, check=check)
    fitting = [r for r in requests if r.status != RequestStatus.FINISHED_ERROR]
    assert {r.request_id: r.output_token_ids for r in fitting} == reference_outputs(fitting)
    capacity = scheduler.block_manager.num_blocks * scheduler.block_manager.block_size
    for r in requests:
        if r.status == RequestStatus.FINISHED_ERROR:
            assert r.num_tokens + (0 if r.num_output_tokens == 0 else -1) >= capacity
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks


def make_group(request_id, prompt_len, n, first=1, **params):
    """An n-sample request as the engine builds it; returns its leader (the request the scheduler is given)."""
    from latentserve.engine.parallel_sampling import SampleGroup, sample_request_id

    params = SamplingParams(n=n, **params)
    prompt = [(first + 7 * i) % VOCAB + 2 for i in range(prompt_len)]
    samples = [Request(sample_request_id(request_id, i), prompt, params.for_sample(i)) for i in range(n)]
    return SampleGroup(request_id, params, samples).leader


@pytest.mark.parametrize("num_blocks, budget, caching", [(64, 32, False), (64, 32, True), (14, 8, False), (14, 8, True)])
def test_samples_fork_the_leaders_prompt_blocks(num_blocks, budget, caching):
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_model_len=64),
                          BlockManager(num_blocks, 4, enable_prefix_caching=caching))
    scheduler.fake_kv = FakeKVCache(4)
    groups = [make_group("g", 14, 3, max_tokens=6), make_group("h", 9, 2, max_tokens=5, first=40)]
    others = [make_request("x", 7, max_tokens=6, first=80)]
    steps = drive(scheduler, {0: groups[:1] + others, 2: groups[1:]})  # FakeKVCache checks every read and write
    samples = [s for leader in groups for s in leader.group.samples]
    assert all(s.status == RequestStatus.FINISHED_LENGTH for s in samples + others)
    # The fake model depends on the sequence only: every sample equals the request run alone.
    for s in samples:
        alone = reference_outputs([Request("alone", s.prompt_token_ids, s.sampling_params)])["alone"]
        assert s.output_token_ids == alone
    if num_blocks == 64:  # no preemption: each other sample computed only its last prompt block
        assert scheduler.block_manager.num_forked_blocks == 2 * 3 + 1 * 2
        computed = {}
        for out in steps:
            for s in out.scheduled:
                if s.num_computed_tokens < s.request.num_prompt_tokens:
                    computed[s.request.request_id] = computed.get(s.request.request_id, 0) + s.num_new_tokens
        assert computed == {"g": 14, "1_g": 2, "2_g": 2, "x": 7, "h": 9, "1_h": 1}
    else:
        assert any(s.num_preemptions for s in samples)
    assert scheduler.block_manager.usage == 0 and not scheduler.groups and not scheduler.requests


def test_group_whose_leader_cannot_fit_errors_every_sample():
    scheduler = make_scheduler(num_blocks=4, max_model_len=64)
    leader = make_group("big", 30, 3)
    drive(scheduler, {0: [leader]})
    assert [s.status for s in leader.group.samples] == [RequestStatus.FINISHED_ERROR] * 3
    assert not scheduler.groups and scheduler.block_manager.usage == 0


@pytest.mark.parametrize("seed", range(10))
def test_random_workload_with_groups_and_aborts(seed):
    from latentserve.engine.parallel_sampling import SampleGroup, sample_request_id

    gen = torch.Generator().manual_seed(100 + seed)

    def rand(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=gen))

    scheduler = Scheduler(
        SchedulerConfig(max_num_batched_tokens=rand(8, 40), max_num_seqs=rand(2, 8), max_model_len=64),
        BlockManager(rand(10, 24), rand(2, 5), enable_prefix_caching=bool(rand(0, 2))),
    )
    scheduler.fake_kv = FakeKVCache(scheduler.block_manager.block_size)
    shared = [rand(2, VOCAB) for _ in range(12)]
    arrivals, leaders = {}, []
    for i in range(8):
        prompt = (shared[: rand(0, 12)] + [rand(2, VOCAB) for _ in range(rand(1, 16))])[:30]
        params = SamplingParams(n=rand(1, 4), max_tokens=rand(1, 10))
        samples = [Request(sample_request_id(f"r{i}", k), prompt, params.for_sample(k)) for k in range(params.n)]
        leader = SampleGroup(f"r{i}", params, samples).leader if params.n > 1 else samples[0]
        leaders.append(leader)
        arrivals.setdefault(rand(0, 10), []).append(leader)
    to_abort = {rand(1, 20): leaders[rand(0, 8)].request_id for _ in range(2)}
    steps = []

    def check(out):
        steps.append(out)
        if len(steps) in to_abort:
            scheduler.abort_request(to_abort[len(steps)])

    drive(scheduler, arrivals, check=check)
    for leader in leaders:
        for sample in leader.group.samples if leader.group else [leader]:
            assert sample.is_finished
            if sample.status == RequestStatus.FINISHED_LENGTH:
                alone = reference_outputs([Request("alone", sample.prompt_token_ids, sample.sampling_params)])["alone"]
                assert sample.output_token_ids == alone
    assert not scheduler.groups and not scheduler.requests and scheduler.block_manager.usage == 0
