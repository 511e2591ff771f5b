"""A request whose allowed tokens are all banned at its first token is refused up front, naming the fields."""
import pytest

from latentserve import LLM, SamplingParams
from latentserve.engine.detokenizer import bad_words_token_ids


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32")


def test_allowed_ids_that_are_all_stop_tokens_before_min_tokens_are_refused(llm):
    eos = llm.engine.tokenizer.eos_token_id
    params = SamplingParams(allowed_token_ids=[eos, 7], stop_token_ids=[7], min_tokens=2, max_tokens=4)
    with pytest.raises(ValueError, match=r"allowed_token_ids .* min_tokens=2"):
        llm.generate(["And God said"], params)


def test_allowed_ids_all_banned_as_bad_words_are_refused(llm):
    word = "unto"  # one token with and without its leading space: banned at every step
    ids = [entry[0] for entry in bad_words_token_ids(llm.engine.tokenizer, [word])]
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate(["And God said"], SamplingParams(allowed_token_ids=ids, bad_words=[word], max_tokens=4))
    # One allowed id left over: that one is sampled.
    out = llm.generate(["And God said"], SamplingParams(allowed_token_ids=ids + [7], bad_words=[word], max_tokens=2))
    assert out[0].outputs[0].token_ids == [7, 7]


def test_a_stop_token_among_other_allowed_ids_is_fine(llm):
    eos = llm.engine.tokenizer.eos_token_id
    out = llm.generate(["And God said"], SamplingParams(allowed_token_ids=[eos, 7], min_tokens=2, max_tokens=3,
                                                         temperature=0.0))
    assert out[0].outputs[0].token_ids[:2] == [7, 7]
