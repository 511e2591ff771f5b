"""The batched logits processors against a naive per-request loop written from vLLM's documented semantics."""
import math
import random

import pytest
import torch

from latentserve.engine.sampler import Sampler, SamplingMetadata
from latentserve.sampling_params import SamplingParams

V = 40
NEG_INF = float("-inf")


def reference_row(logits, params, prompt, output, bad_words, banned):
    """One request, one position: a plain Python rendering of vLLM's processing before temperature."""
    x = list(logits)
    if params.allowed_token_ids is not None:
        x = [v if t in params.allowed_token_ids else NEG_INF for t, v in enumerate(x)]
    for word in bad_words:
        prefix = word[:-1]
        if len(prefix) <= len(output) and output[len(output) - len(prefix):] == prefix:
            x[word[-1]] = NEG_INF
    for t in banned:
        x[t] = NEG_INF
    for t, bias in (params.logit_bias or {}).items():
        x[t] += bias
    for t in range(len(x)):
        if t in prompt or t in output:
            x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
        count = output.count(t)
        x[t] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    return x


def reference_min_p_keep(processed, temperature, min_p):
    scaled = [v / temperature for v in processed]
    m = max(scaled)
    probs = [math.exp(v - m) if v > NEG_INF else 0.0 for v in scaled]
    total = sum(probs)
    top = max(probs) / total
    return {t for t, p in enumerate(probs) if p / total >= min_p * top}


def random_case(rng: random.Random, row: int):
    """Params and token history of one row; every processor is on in some rows and off in others."""
    kwargs = {"temperature": rng.choice([0.0, 0.7, 1.3])}
    if row % 2:
        kwargs.update(presence_penalty=rng.uniform(-2, 2), frequency_penalty=rng.uniform(-2, 2),
                      repetition_penalty=rng.choice([0.5, 1.0, 1.7]))
    if row % 3 == 0:
        kwargs["logit_bias"] = {rng.randrange(V): rng.uniform(-100, 100) for _ in range(rng.randint(1, 4))}
    if row % 4 == 1:
        kwargs["allowed_token_ids"] = rng.sample(range(V), rng.randint(1, 12))
    if row % 5 == 2:
        kwargs["min_p"] = rng.uniform(0.01, 0.5)
    prompt = [rng.randrange(V) for _ in range(rng.randint(1, 12))]
    output = [rng.randrange(V) for _ in range(rng.randint(0, 8))]
    bad_words = []
    if row % 3 == 1:
        # One word that the output ends with (so it must fire), one random, one single token.
        k = min(len(output), rng.randint(1, 4))
        bad_words = [output[len(output) - k:] + [rng.randrange(V)], [rng.randrange(V) for _ in range(rng.randint(2, 7))],
                     [rng.randrange(V)]]
    banned = rng.sample(range(V), 2) if row % 4 == 3 else []
    return SamplingParams(**kwargs), prompt, output, bad_words, banned


@pytest.mark.parametrize("seed", range(6))
def test_processed_logits_match_naive_per_request_loop(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    cases = [random_case(rng, row) for row in range(12)]
    params, prompts, outputs, bad_words, banned = (list(c) for c in zip(*cases))
    logits = torch.randn(len(cases), V) * 4
    md = SamplingMetadata.from_params(params, [None] * len(params), V, banned_token_ids=banned,
                                      prompt_token_ids=prompts, output_token_ids=outputs, bad_words_token_ids=bad_words)
    processed = Sampler.process_logits(logits.clone(), md)
    for row, case in enumerate(cases):
        expected = torch.tensor(reference_row(logits[row].tolist(), *case), dtype=torch.float32)
        assert torch.equal(processed[row].isinf(), expected.isinf()), row
        finite = expected.isfinite()
        torch.testing.assert_close(processed[row][finite], expected[finite], rtol=1e-5, atol=1e-4)
    # The sampler itself: greedy rows take the processed argmax; every row samples only a token that survives
    # processing and (after temperature) min-p; logprobs stay those of the raw logits.
    out = Sampler()(logits, md)
    for row, (p, *rest) in enumerate(cases):
        expected = reference_row(logits[row].tolist(), p, *rest)
        token = out.sampled_token_ids[row]
        if p.is_greedy:
            assert token == max(range(V), key=lambda t: expected[t])
        else:
            assert expected[token] > NEG_INF
            assert token in reference_min_p_keep(expected, p.temperature, p.min_p)


def test_bad_words_fire_only_on_the_output_tail():
    logits = torch.zeros(3, V)
    logits[:, 9] = 5.0
    params = [SamplingParams(temperature=0)] * 3
    # Row 0's output is shorter than the longest word of the batch: its tail is padded, not cut.
    words = [[[4, 5, 9], [1, 2, 3, 4]], [[4, 5, 9]], [[9]]]
    outputs = [[4, 5], [4, 5, 1], []]
    # Row 1's prompt ends with 4, 5: vLLM matches the output only, so the word does not fire there.
    md = SamplingMetadata.from_params(params, [None] * 3, V, prompt_token_ids=[[0], [4, 5], [0]],
                                      output_token_ids=outputs, bad_words_token_ids=words)
    assert Sampler()(logits, md).sampled_token_ids[0] != 9
    assert Sampler()(logits, md).sampled_token_ids[1] == 9
    assert Sampler()(logits, md).sampled_token_ids[2] != 9


def test_logit_bias_flips_greedy_and_allowed_ids_restrict():
    torch.manual_seed(7)
    logits = torch.randn(2, V)
    top = logits.argmax(-1).tolist()
    params = [SamplingParams(temperature=0, logit_bias={top[0]: -100}),
              SamplingParams(temperature=1.0, allowed_token_ids=[3, 11])]
    sampled = [Sampler()(logits, SamplingMetadata.from_params(params, [None, None], V)).sampled_token_ids
               for _ in range(20)]
    assert all(s[0] != top[0] and s[0] == logits[0].topk(2).indices[1] for s in sampled)
    assert {s[1] for s in sampled} <= {3, 11}


def test_min_p_sampling_follows_the_kept_distribution():
    torch.manual_seed(8)
    row = torch.randn(V) * 2
    n = 40_000
    params = SamplingParams(temperature=0.8, min_p=0.2)
    out = Sampler()(row.expand(n, V).clone(), SamplingMetadata.from_params([params] * n, [None] * n, V))
    counts = torch.bincount(torch.tensor(out.sampled_token_ids), minlength=V).float() / n
    kept = sorted(reference_min_p_keep(row.tolist(), 0.8, 0.2))
    expected = torch.zeros(V)
    expected[kept] = torch.softmax(row[kept] / 0.8, -1)
    assert set(torch.nonzero(counts).flatten().tolist()) <= set(kept)
    assert torch.allclose(counts, expected, atol=0.015)
