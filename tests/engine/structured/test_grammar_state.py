"""The grammar state of one request: compiled off the step (the scheduler passes over it meanwhile), a matcher that
follows the output tokens forwards and back, the end of the reasoning."""
from concurrent.futures import Future

import xgrammar as xgr

from latentserve.assets import DEFAULT_MODEL_DIR
from latentserve.engine.block_manager import BlockManager
from latentserve.engine.detokenizer import load_tokenizer
from latentserve.engine.request import Request
from latentserve.engine.scheduler import Scheduler, SchedulerConfig
from latentserve.engine.structured import StructuredOutputManager, StructuredOutputRequest, grammar_bitmask
from latentserve.sampling_params import SamplingParams, StructuredOutputsParams

TOKENIZER = load_tokenizer(DEFAULT_MODEL_DIR)
SPEC = StructuredOutputsParams(choice=["the LORD", "Moses"])


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def allowed(state: StructuredOutputRequest) -> set[int]:
    bitmask = grammar_bitmask([None, state], 4096)
    return {i for i in range(4096) if (bitmask[1, i // 32].item() >> (i % 32)) & 1}


def test_scheduler_passes_over_a_request_whose_grammar_is_compiling():
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
                          BlockManager(16, 4, False))
    pending: Future = Future()
    first = Request("constrained", [5, 6, 7], SamplingParams(structured_outputs=SPEC))
    first.structured_output = StructuredOutputRequest(SPEC, pending)
    second = Request("plain", [8, 9], SamplingParams())
    scheduler.add_request(first)
    scheduler.add_request(second)
    assert [s.request.request_id for s in scheduler.schedule().scheduled] == ["plain"]
    assert list(scheduler.waiting) == [first]  # kept its place
    pending.set_exception(RuntimeError("boom"))  # a compile failure ends the request with its reason
    out = scheduler.schedule()
    assert out.finished == [first] and "failed to compile: boom" in first.error


def test_matcher_follows_output_tokens_forwards_and_back():
    manager = StructuredOutputManager(TOKENIZER, 4096)
    state = manager.new_request(SPEC)
    state.grammar.result()
    start = allowed(state)
    lord, moses = ids("the LORD"), ids("Moses")
    assert lord[0] in start and moses[0] in start
    assert state.sync(lord) and TOKENIZER.eos_token_id in allowed(state)
    assert state.sync([])  # rolled back to the start, e.g. a draft rejected
    assert allowed(state) == start
    assert state.sync(moses + [TOKENIZER.eos_token_id]) and state.is_terminated
    assert manager.new_request(SPEC).grammar is state.grammar  # compiled once per distinct spec


def test_a_token_off_the_grammar_is_rejected():
    state = StructuredOutputManager(TOKENIZER, 4096).new_request(SPEC)
    state.grammar.result()
    assert not state.sync(ids("Aaron"))
    assert state.rejected_token == ids("Aaron")[0]


def test_constraint_starts_after_the_reasoning_end_token():
    end = 7
    state = StructuredOutputManager(TOKENIZER, 4096).new_request(SPEC, reasoning_end_token_id=end)
    state.grammar.result()
    thinking = ids("I think, then") + ids(" more")
    assert state.sync(thinking) and not state.constrains_next
    assert grammar_bitmask([state], 4096) is None  # reasoning is free
    assert state.sync(thinking + [end]) and state.constrains_next
    assert state.sync(thinking + [end] + ids("Moses"))
    assert allowed(state) == {TOKENIZER.eos_token_id}
    assert isinstance(state.matcher, xgr.GrammarMatcher)


def test_a_character_level_tokenizer_works_too(tmp_path):
    """Not byte-level: xgrammar reads the vocabulary's type; added (control) tokens are never allowed."""
    from tests.server.conftest import write_tokenizer
    write_tokenizer(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    manager = StructuredOutputManager(tokenizer, 96)
    state = manager.new_request(StructuredOutputsParams(regex="(hi|ok) there"))
    state.grammar.result()
    bitmask = grammar_bitmask([state], 96)
    allowed_ids = {i for i in range(96) if (bitmask[0, i // 32].item() >> (i % 32)) & 1}
    assert {tokenizer.decode([i]) for i in allowed_ids} == {"h", "o"}
    assert state.sync(tokenizer.encode("ok there", add_special_tokens=False))
    assert {i for i in range(96) if (grammar_bitmask([state], 96)[0, i // 32].item() >> (i % 32)) & 1} == {
        tokenizer.eos_token_id}


def test_bitmask_application_matches_xgrammar_kernel():
    import torch
    from latentserve.engine.structured import apply_grammar_bitmask
    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, 129), dtype=torch.int32, generator=generator)
    bitmask[2] = -1  # an unconstrained row
    logits = torch.randn(5, 4107, generator=generator)
    ours, theirs = logits.clone(), logits.clone()
    apply_grammar_bitmask(ours, bitmask)
    xgr.apply_token_bitmask_inplace(theirs, bitmask)
    assert torch.equal(ours, theirs) and torch.equal(ours[2], logits[2])
