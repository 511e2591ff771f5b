import math

import pytest
import torch

from latentserve.engine.request import Request
from latentserve.engine.sampler import (
    Sampler,
    SamplingMetadata,
    apply_top_k,
    apply_top_p,
    compute_prompt_logprobs,
)
from latentserve.sampling_params import SamplingParams

V = 50


def metadata(params, generators=None, banned=None):
    return SamplingMetadata.from_params(params, generators or [None] * len(params), V, banned_token_ids=banned)


def reference_keep(logits_row, temperature, top_k, top_p):
    """Naive per-row kept set: k largest after temperature, then the smallest head reaching top_p."""
    scaled = [x / temperature for x in logits_row.tolist()]
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    if top_k > 0:
        order = order[:top_k]
    m = max(scaled[i] for i in order)
    weights = [math.exp(scaled[i] - m) for i in order]
    total = sum(weights)
    kept, mass = [], 0.0
    for i, w in zip(order, weights):
        if mass >= top_p:
            break
        kept.append(i)
        mass += w / total
    return set(kept)


def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(6, V)
    out = Sampler()(logits, metadata([SamplingParams(temperature=0, top_k=3, top_p=0.5, seed=1)] * 6))
    assert out.sampled_token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 6


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (0, 0.6), (7, 0.5), (1, 1.0), (V + 10, 0.95)])
def test_top_k_top_p_masks_match_reference(top_k, top_p):
    torch.manual_seed(1)
    logits = torch.randn(8, V) * 3
    temps = torch.tensor([0.5, 1.0, 1.5, 2.0] * 2)
    params = [SamplingParams(temperature=float(t), top_k=top_k, top_p=top_p) for t in temps]
    md = metadata(params)
    masked = logits / temps.unsqueeze(-1)
    if md.top_k is not None:
        masked = apply_top_k(masked, md.top_k)
    if md.top_p is not None:
        masked = apply_top_p(masked, md.top_p)
    for row in range(8):
        kept = set(torch.nonzero(masked[row] > float("-inf")).flatten().tolist())
        assert kept == reference_keep(logits[row], float(temps[row]), top_k, top_p)


def test_top_p_one_keeps_tiny_tail():
    logits = torch.tensor([[30.0, 0.0, -30.0, -60.0]])
    assert torch.isfinite(apply_top_p(logits, torch.tensor([1.0]))).all()


def test_sampling_follows_the_truncated_distribution():
    torch.manual_seed(2)
    row = torch.randn(V)
    n = 40_000
    params = SamplingParams(temperature=0.7, top_k=10, top_p=0.8)
    out = Sampler()(row.expand(n, V).clone(), metadata([params] * n))
    counts = torch.bincount(torch.tensor(out.sampled_token_ids), minlength=V).float() / n
    kept = reference_keep(row, 0.7, 10, 0.8)
    expected = torch.zeros(V)
    idx = torch.tensor(sorted(kept))
    expected[idx] = torch.softmax(row[idx] / 0.7, -1)
    assert set(torch.nonzero(counts).flatten().tolist()) <= kept
    assert torch.allclose(counts, expected, atol=0.015)


def test_seeded_request_ignores_batch_composition():
    torch.manual_seed(3)
    steps = [torch.randn(4, V) for _ in range(5)]
    seeded = SamplingParams(temperature=1.0, seed=1234, top_p=0.9)

    def run(row, batch_size, other_seed):
        gen = torch.Generator().manual_seed(1234)
        tokens = []
        for logits in steps:
            params = [SamplingParams(temperature=1.3, seed=other_seed)] * batch_size
            gens = [torch.Generator().manual_seed(other_seed) if other_seed is not None else None] * batch_size
            params[row], gens[row] = seeded, gen
            batch = logits[:batch_size].clone()
            batch[row] = logits[0]
            tokens.append(Sampler()(batch, metadata(params, gens)).sampled_token_ids[row])
        return tokens

    alone = run(0, 1, None)
    assert run(2, 4, None) == alone and run(1, 3, 99) == alone
    # Through requests: the generator lives with the request, created on first use.
    r = Request("r", [1], seeded)
    via_request = []
    for logits in steps:
        md = SamplingMetadata.from_requests([Request("x", [1], SamplingParams()), r], V)
        via_request.append(Sampler()(torch.stack([logits[1], logits[0]]), md).sampled_token_ids[1])
    assert via_request == alone


def naive_rank(row: torch.Tensor, token_id: int) -> int:
    """vLLM's rank, counted one entry at a time: the entries at least as likely as the token, itself included."""
    value = float(row[token_id])
    return sum(1 for x in row.tolist() if x >= value)


def test_logprobs_hold_chosen_and_top_k_of_raw_logits():
    torch.manual_seed(4)
    logits = torch.randn(3, V)
    params = [SamplingParams(temperature=2.0, logprobs=3), SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=0)]
    out = Sampler()(logits, metadata(params))
    ref = torch.log_softmax(logits.double(), -1)
    first = out.logprobs[0]
    assert first.token_id == out.sampled_token_ids[0]
    assert first.logprob == pytest.approx(float(ref[0, first.token_id]), abs=1e-5)
    assert first.rank == naive_rank(ref[0], first.token_id)
    assert [t for t, _ in first.top] == ref[0].topk(3).indices.tolist()
    for token_id, value in first.top:
        assert value == pytest.approx(float(ref[0, token_id]), abs=1e-5)
    assert out.logprobs[1] is None
    last = out.logprobs[2]
    assert (last.token_id, last.rank, last.top) == (int(ref[2].argmax()), 1, [])
    assert last.logprob == pytest.approx(float(ref[2].max()), abs=1e-5)


def test_logprobs_minus_one_hold_the_whole_row_by_rank():
    """Rows asking -1 get every entry, likeliest first; rows asking a finite k or none are as before."""
    torch.manual_seed(7)
    logits = torch.randn(4, V)
    params = [SamplingParams(temperature=1.0, seed=0, logprobs=-1), SamplingParams(temperature=0, logprobs=3),
              SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=-1)]
    out = Sampler()(logits, metadata(params))
    ref = torch.log_softmax(logits.double(), -1)
    for row in (0, 3):
        entry = out.logprobs[row]
        ids = [t for t, _ in entry.top]
        assert sorted(ids) == list(range(V))
        values = [value for _, value in entry.top]
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx([float(ref[row, t]) for t in ids], abs=1e-5)
        assert entry.rank == naive_rank(ref[row], entry.token_id)
    assert [t for t, _ in out.logprobs[1].top] == ref[1].topk(3).indices.tolist()
    assert out.logprobs[2] is None
    prompt = compute_prompt_logprobs(logits, [4, 8], -1)
    assert [sorted(t for t, _ in e.top) for e in prompt] == [list(range(V))] * 2


def test_rank_of_a_sampled_token_counts_the_row():
    """Hot sampling picks unlikely tokens: each one's rank is the naive count over its full row."""
    torch.manual_seed(6)
    logits = torch.randn(64, V)
    params = [SamplingParams(temperature=5.0, seed=i, logprobs=2) for i in range(64)]
    out = Sampler()(logits, metadata(params))
    ref = torch.log_softmax(logits.float(), -1)
    ranks = [entry.rank for entry in out.logprobs]
    assert ranks == [naive_rank(ref[row], token) for row, token in enumerate(out.sampled_token_ids)]
    assert max(ranks) > 3  # some sampled tokens lie outside the top-2


def test_rank_counts_ties_against_the_token():
    logits = torch.zeros(1, V)
    logits[0, [4, 9, 30]] = 2.0
    entries = compute_prompt_logprobs(torch.cat([logits, logits]), [9, 5], 1)
    assert [e.rank for e in entries] == [3, V]  # three tokens share the top; every token ties with token 5


def test_banned_tokens_are_never_sampled_but_logprobs_stay_raw():
    logits = torch.zeros(2, V)
    logits[:, 7] = 10.0
    params = [SamplingParams(temperature=0, logprobs=1), SamplingParams(temperature=1.0)]
    out = Sampler()(logits, metadata(params, banned=[[7], [7]]))
    assert 7 not in out.sampled_token_ids
    # The raw top token is the banned one; the chosen token ties with every other one below it.
    assert out.logprobs[0].top[0][0] == 7 and out.logprobs[0].rank == V
    with pytest.raises(ValueError, match="outside the vocabulary"):
        metadata(params, banned=[[V], []])
    r = Request("r", [1], SamplingParams(min_tokens=2, stop_token_ids=[3]), eos_token_id=7)
    assert r.banned_token_ids() == [7, 3]


def test_prompt_logprobs_match_reference():
    torch.manual_seed(5)
    logits = torch.randn(4, V)
    targets = [3, 9, 11]  # the 4th row predicts a sampled token, not a prompt one
    entries = compute_prompt_logprobs(logits, targets, 2)
    ref = torch.log_softmax(logits.double(), -1)
    assert len(entries) == 3
    for row, (entry, target) in enumerate(zip(entries, targets)):
        assert [t for t, _ in entry.top] == ref[row].topk(2).indices.tolist()
        assert entry.token_id == target and entry.rank == naive_rank(ref[row], target)
        assert entry.logprob == pytest.approx(float(ref[row, target]), abs=1e-5)
    assert compute_prompt_logprobs(logits, [], 2) == []
    with pytest.raises(ValueError, match="5 prompt tokens to score but only 4 rows"):
        compute_prompt_logprobs(logits, [1] * 5, 2)


def test_bad_logits_shape():
    with pytest.raises(ValueError, match=r"logits must be \[2, vocab\]"):
        Sampler()(torch.zeros(3, V), metadata([SamplingParams()] * 2))
