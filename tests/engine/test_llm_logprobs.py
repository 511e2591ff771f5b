"""vLLM's Logprob objects in LLM outputs: ranks against a naive count over transformers' full fp32 logprob rows,
decoded tokens against the tokenizer."""
from __future__ import annotations

import pytest
import torch

from latentserve import LLM, Logprob, SamplingParams
from latentserve.assets import DEFAULT_MODEL_DIR
from latentserve.engine.llm_engine import check_logprobs
from tests.checkpoints import load_reference

PROMPT = "And God said, Let there be light: and there was light."
EPS = 1e-4  # the engine's fp32 logprobs against transformers' fp32 ones
K = 5


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_num_seqs=4, num_kv_blocks=64, dtype="float32")  # the embedded model


@pytest.fixture(scope="module")
def reference():
    return load_reference(DEFAULT_MODEL_DIR)


def reference_rows(reference, token_ids: list[int]) -> torch.Tensor:
    """Row i: the full logprob row of the token after token_ids[i]."""
    with torch.no_grad():
        return reference(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)


def naive_rank_bounds(row: torch.Tensor, token_id: int) -> tuple[int, int]:
    """The token's rank (entries at least as likely, itself included), counted one entry at a time; a range as
    wide as the entries within the two runs' round-off of it."""
    value = float(row[token_id])
    entries = row.tolist()
    return 1 + sum(x > value + EPS for x in entries), sum(x >= value - EPS for x in entries)


def check_position(entry: dict[int, Logprob], token_id: int, row: torch.Tensor) -> int:
    """The chosen token's rank and the top-k's ranks 1..K in the order of the reference; returns the rank."""
    assert all(isinstance(lp, Logprob) for lp in entry.values())
    low, high = naive_rank_bounds(row, token_id)
    rank = entry[token_id].rank
    assert low <= rank <= high, (rank, low, high)
    top = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank <= K)
    assert [r for r, _ in top] == list(range(1, K + 1))
    for r, t in top:
        low, high = naive_rank_bounds(row, t)
        assert low <= r <= high, (t, r, low, high)
    for t, lp in entry.items():
        assert lp.logprob == pytest.approx(float(row[t]), abs=EPS)
    return rank


def test_prompt_logprob_ranks_match_a_naive_count(llm, reference):
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=K))[0]
    prompt = out.prompt_token_ids
    rows = reference_rows(reference, prompt)
    assert out.prompt_logprobs[0] is None
    ranks = [check_position(out.prompt_logprobs[pos], prompt[pos], rows[pos - 1]) for pos in range(1, len(prompt))]
    assert max(ranks) > K  # some prompt tokens lie outside the top-k: their rank is counted, not their place


def test_sampled_token_ranks_match_a_naive_count(llm, reference):
    params = SamplingParams(temperature=1.5, seed=0, max_tokens=24, ignore_eos=True, logprobs=K)
    out = llm.generate(PROMPT, params)[0]
    completion = out.outputs[0]
    rows = reference_rows(reference, out.prompt_token_ids + completion.token_ids)[len(out.prompt_token_ids) - 1:]
    ranks = [check_position(entry, token, row) for entry, token, row in zip(completion.logprobs,
                                                                           completion.token_ids, rows, strict=False)]
    assert len(ranks) == 24 and max(ranks) > 1  # hot sampling picked tokens that are not the argmax
    assert completion.cumulative_logprob == pytest.approx(
        sum(entry[t].logprob for entry, t in zip(completion.logprobs, completion.token_ids)), abs=1e-4)


def test_greedy_tokens_rank_first(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2))[0]
    completion = out.outputs[0]
    assert [entry[t].rank for entry, t in zip(completion.logprobs, completion.token_ids)] == [1] * 8


def test_decoded_token_is_the_tokens_text(llm):
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=8, logprobs=3, prompt_logprobs=3)
    out = llm.generate(PROMPT, params)[0]
    tokenizer = llm.get_tokenizer()
    entries = [e for e in out.prompt_logprobs + out.outputs[0].logprobs if e is not None]
    for entry in entries:
        for token_id, lp in entry.items():
            assert lp.decoded_token == tokenizer.decode([token_id], skip_special_tokens=False)
    assert len(entries) == len(out.prompt_token_ids) - 1 + 8 and all(len(e) >= 3 for e in entries)


@pytest.fixture(scope="module")
def llm_uncapped() -> LLM:
    return LLM(max_num_seqs=4, num_kv_blocks=64, dtype="float32", max_logprobs=-1)


def check_whole_row(entry: dict[int, Logprob], token_id: int, row: torch.Tensor) -> None:
    """logprobs=-1: every vocabulary id in vLLM's order (the chosen token, then by rank 1..V), with the reference's
    full row of logprobs."""
    vocab_size = row.shape[-1]
    assert sorted(entry) == list(range(vocab_size)) and next(iter(entry)) == token_id
    ranks = [lp.rank for lp in entry.values()]
    assert sorted(ranks) == list(range(1, vocab_size + 1)) and ranks[1:] == sorted(ranks[1:])
    by_rank = [lp.logprob for lp in sorted(entry.values(), key=lambda lp: lp.rank)]
    assert by_rank == sorted(by_rank, reverse=True)
    got = torch.tensor([entry[t].logprob for t in range(vocab_size)], dtype=torch.float64)
    assert (got - row.double()).abs().max() < EPS
    assert float(got.exp().sum()) == pytest.approx(1.0, abs=1e-5)
    low, high = naive_rank_bounds(row, token_id)
    assert low <= entry[token_id].rank <= high


def test_prompt_logprobs_of_the_whole_vocabulary(llm_uncapped, reference):
    out = llm_uncapped.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=-1))[0]
    prompt = out.prompt_token_ids
    rows = reference_rows(reference, prompt)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        check_whole_row(out.prompt_logprobs[pos], prompt[pos], rows[pos - 1])


def test_sampled_logprobs_of_the_whole_vocabulary(llm_uncapped, reference):
    params = SamplingParams(temperature=1.5, seed=3, max_tokens=8, ignore_eos=True, logprobs=-1)
    out = llm_uncapped.generate(PROMPT, params)[0]
    completion = out.outputs[0]
    rows = reference_rows(reference, out.prompt_token_ids + completion.token_ids)[len(out.prompt_token_ids) - 1:]
    assert len(completion.logprobs) == 8
    for entry, token, row in zip(completion.logprobs, completion.token_ids, rows):
        check_whole_row(entry, token, row)
    assert max(entry[t].rank for entry, t in zip(completion.logprobs, completion.token_ids)) > 1


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_whole_vocabulary_refused_under_a_smaller_cap(llm, llm_uncapped, name):
    vocab_size = llm.engine.model.config.vocab_size
    with pytest.raises(ValueError, match=rf"{name}=-1 \(the whole vocabulary: {vocab_size} tokens\) exceeds this "
                                         r"engine's max_logprobs=20 \(--max-logprobs\)"):
        llm.generate(PROMPT, SamplingParams(**{name: -1}))
    with pytest.raises(ValueError, match=rf"{name}={vocab_size + 1} exceeds the vocabulary \({vocab_size} tokens\)"):
        llm_uncapped.generate(PROMPT, SamplingParams(**{name: vocab_size + 1}))


def test_a_cap_of_the_vocabulary_size_allows_the_whole_vocabulary():
    check_logprobs(SamplingParams(logprobs=-1, prompt_logprobs=-1), max_logprobs=100, vocab_size=100)
    with pytest.raises(ValueError, match=r"prompt_logprobs=-1 \(the whole vocabulary: 100 tokens\) exceeds this "
                                         r"engine's max_logprobs=99"):
        check_logprobs(SamplingParams(prompt_logprobs=-1), max_logprobs=99, vocab_size=100)
