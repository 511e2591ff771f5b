"""Rejection sampling keeps the target's distribution exactly: whole speculative generations from a bigram
target and a mismatched bigram draft, compared with the target's own joint distribution of the first tokens."""
from __future__ import annotations

import itertools

import pytest
import torch
from scipy.stats import chisquare

from latentserve.engine.spec_decode import PLACEHOLDER_TOKEN_ID, rejection_sample

VOCAB = 4
LENGTH = 3  # generated tokens whose joint distribution is checked: VOCAB**LENGTH cells
SAMPLES = 30000


def _tables(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Bigram target P[prev] and a deliberately different draft Q[prev], both `[VOCAB, VOCAB]`."""
    g = torch.Generator().manual_seed(seed)
    target, draft = (torch.rand(2, VOCAB, VOCAB, generator=g) * 2.5).softmax(-1)
    return target, draft


def _top_k_top_p(table: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Naive per-row top-k then top-p (smallest prefix of the sorted probabilities reaching top_p), renormalized."""
    out = torch.zeros_like(table)
    for row, probs in enumerate(table):
        order = probs.argsort(descending=True)[:top_k]
        kept = probs[order] / probs[order].sum()
        cut = int((kept.cumsum(0) < top_p).sum()) + 1
        out[row, order[:cut]] = kept[:cut] / kept[:cut].sum()
    return out


def _speculate(target, draft, k: int, greedy_draft: bool = False, lie_about_q: bool = False) -> torch.Tensor:
    """SAMPLES generations from context token 0 by drafting up to k tokens from `draft` and verifying against
    `target`, step after step -> the first LENGTH tokens `[SAMPLES, LENGTH]`."""
    out = torch.full((SAMPLES, LENGTH + k + 1), PLACEHOLDER_TOKEN_ID)
    lengths = torch.zeros(SAMPLES, dtype=torch.long)
    last = torch.zeros(SAMPLES, dtype=torch.long)
    rows = torch.arange(SAMPLES)
    while bool((lengths < LENGTH).any()):
        num_drafts = torch.randint(0, k + 1, (SAMPLES,))  # requests draft different counts
        drafts, q = [], []
        prev = last
        for _ in range(k):
            q_j = draft[prev]
            d = q_j.argmax(-1) if greedy_draft else torch.multinomial(q_j, 1)[:, 0]
            drafts.append(d)
            q.append(q_j)
            prev = d
        drafts_t = torch.stack(drafts, 1)
        prefix = torch.cat([last[:, None], drafts_t], 1)  # the target scores token j+1 after prefix[j]
        target_probs = target[prefix]
        draft_probs = None if greedy_draft else torch.stack(q, 1)
        if lie_about_q:  # claim the drafts came from the target itself: every draft passes
            draft_probs = target_probs[:, :k]
        greedy = torch.zeros(SAMPLES, dtype=torch.bool)
        emitted = rejection_sample(drafts_t, num_drafts, draft_probs, target_probs, greedy)
        counts = (emitted != PLACEHOLDER_TOKEN_ID).sum(1)
        assert bool(((counts >= 1) & (counts <= num_drafts + 1)).all())
        for j in range(k + 1):
            write = (j < counts) & (lengths + j < out.shape[1])
            out[rows[write], (lengths + j)[write]] = emitted[write, j]
        last = emitted[rows, counts - 1]
        lengths += counts
    return out[:, :LENGTH]


def _p_value(samples: torch.Tensor, target: torch.Tensor) -> float:
    """Chi-square goodness of fit of the sampled joint of LENGTH tokens to the target chain from token 0."""
    cells = list(itertools.product(range(VOCAB), repeat=LENGTH))
    expected = torch.tensor([
        torch.prod(torch.stack([target[prev, tok] for prev, tok in zip((0, *c[:-1]), c)])).item() for c in cells
    ]) * SAMPLES
    index = (samples * VOCAB ** torch.arange(LENGTH - 1, -1, -1)).sum(1)
    observed = torch.bincount(index, minlength=len(cells)).double()
    # Cells too rare for the chi-square approximation are pooled into one.
    rare = expected < 5
    assert observed[expected == 0].sum() == 0, "sampled a sequence the target rules out"
    obs = torch.cat([observed[~rare], observed[rare].sum()[None]])
    exp = torch.cat([expected[~rare], expected[rare].sum()[None]]).double()
    keep = exp > 0
    return float(chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


@pytest.mark.parametrize("k, greedy_draft", [(1, False), (3, False), (2, True)])
def test_speculative_generation_has_the_targets_distribution(k: int, greedy_draft: bool) -> None:
    torch.manual_seed(k)
    target, draft = _tables()
    assert _p_value(_speculate(target, target, k), target) > 1e-3  # sanity: a perfect draft
    assert _p_value(_speculate(target, draft, k, greedy_draft), target) > 1e-3


def test_top_k_and_top_p_targets_are_kept_exactly() -> None:
    torch.manual_seed(5)
    target, draft = _tables()
    target, draft = _top_k_top_p(target, 3, 0.8), _top_k_top_p(draft, 3, 0.9)
    assert (target == 0).any()  # the processing really removed tokens
    assert _p_value(_speculate(target, draft, 2), target) > 1e-3


def test_the_check_catches_a_wrong_draft_distribution() -> None:
    """Power of the test above: verifying drafts against a q they were not drawn from is biased, and it shows.
    (A one-hot q is never wrong: conditioned on the drawn token it is the distribution it came from.)"""
    torch.manual_seed(6)
    target, draft = _tables()
    assert _p_value(_speculate(target, draft, 2, lie_about_q=True), target) < 1e-6


def test_greedy_rows_follow_the_argmax_chain() -> None:
    g = torch.Generator().manual_seed(0)
    batch, k, vocab = 64, 4, 7
    target_probs = torch.rand(batch, k + 1, vocab, generator=g).softmax(-1)
    argmax = target_probs.argmax(-1)
    # Drafts that agree with the argmax for a random number of positions, then not.
    agree = torch.randint(0, k + 1, (batch,), generator=g)
    drafts = torch.where(torch.arange(k)[None] < agree[:, None], argmax[:, :k], (argmax[:, :k] + 1) % vocab)
    num_drafts = torch.randint(0, k + 1, (batch,), generator=g)
    out = rejection_sample(drafts, num_drafts, None, target_probs, torch.ones(batch, dtype=torch.bool))
    for row in range(batch):
        n = min(int(agree[row]), int(num_drafts[row]))  # accepted drafts
        expected = argmax[row, : n + 1].tolist() + [PLACEHOLDER_TOKEN_ID] * (k - n)
        assert out[row].tolist() == expected


def test_seeded_rows_repeat() -> None:
    target, draft = _tables()
    drafts = torch.multinomial(draft[torch.zeros(8, dtype=torch.long)], 3, replacement=True)
    probs = target[torch.cat([torch.zeros(8, 1, dtype=torch.long), drafts], 1)]
    q = draft[torch.cat([torch.zeros(8, 1, dtype=torch.long), drafts[:, :-1]], 1)]

    def run() -> torch.Tensor:
        gens = {row: torch.Generator().manual_seed(row) for row in range(8)}
        return rejection_sample(drafts, torch.full((8,), 3), q, probs, torch.zeros(8, dtype=torch.bool), gens)

    assert torch.equal(run(), run())


def test_rejects_bad_shapes() -> None:
    drafts = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample(drafts, torch.full((2,), 3), None, torch.rand(2, 3, 5), torch.zeros(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="num_draft_tokens must be in"):
        rejection_sample(drafts, torch.full((2,), 4), None, torch.rand(2, 4, 5), torch.zeros(2, dtype=torch.bool))


def test_greedy_verification_shortcut_equals_rejection_sampling() -> None:
    """verify()'s all-greedy path walks the argmax chain in Python; rejection_sample's greedy rows are the reference."""
    from latentserve.engine.spec_decode.verifier import _argmax_chains

    g = torch.Generator().manual_seed(0)
    k, vocab = 3, 5
    drafts = [[int(t) for t in torch.randint(0, vocab, (n,), generator=g)] for n in (0, 1, 3, 3, 2, 3)]
    logits = torch.randn(sum(len(d) + 1 for d in drafts), vocab, generator=g)
    argmax = logits.argmax(-1)
    for i, d in enumerate(drafts):  # make some drafts right, so chains of every length occur
        start = sum(len(x) + 1 for x in drafts[:i])
        d[: i % (len(d) + 1)] = argmax[start : start + i % (len(d) + 1)].tolist()
    probs = torch.zeros(len(drafts), k + 1, vocab)
    draft_ids = torch.full((len(drafts), k), PLACEHOLDER_TOKEN_ID)
    start = 0
    for i, d in enumerate(drafts):
        draft_ids[i, : len(d)] = torch.tensor(d, dtype=torch.long)
        probs[i, : len(d) + 1] = logits[start : start + len(d) + 1]
        start += len(d) + 1
    out = rejection_sample(draft_ids, torch.tensor([len(d) for d in drafts]), None, probs,
                           torch.ones(len(drafts), dtype=torch.bool))
    expected = [[t for t in row if t != PLACEHOLDER_TOKEN_ID] for row in out.tolist()]
    got = _argmax_chains(argmax.tolist(), drafts)
    assert got == expected
    assert sorted({len(row) for row in got}) == [1, 2, 3, 4]  # every chain length was exercised
