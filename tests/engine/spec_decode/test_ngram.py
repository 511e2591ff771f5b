"""n-gram speculative decoding (drafts looked up in the request's own tokens): the lookup against a brute-force
search, the config's defaults and refusals, and the engine's greedy tokens equal to those without speculation on a
model without an MTP layer."""
from __future__ import annotations

import random

import pytest

from latentserve import LLM, SamplingParams
from latentserve.engine.spec_decode.config import SpeculativeConfig
from latentserve.engine.spec_decode.ngram_proposer import lookup
from tests.checkpoints import make_checkpoint


def brute_force(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """For n from max_n down to min_n, the last earlier place the final n tokens occurred; the k tokens after it."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@pytest.mark.parametrize("seed", range(200))
def test_lookup_equals_brute_force(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(rng.choice([2, 3, 5, 50])) for _ in range(rng.randrange(1, 60))]
    min_n = rng.randrange(1, 4)
    max_n = rng.randrange(min_n, 7)
    k = rng.randrange(1, 6)
    assert lookup(tokens, min_n, max_n, k) == brute_force(tokens, min_n, max_n, k)


def test_lookup_examples():
    assert lookup([1, 2, 3, 9, 1, 2, 3], 1, 3, 2) == [9, 1]  # "1 2 3" seen before: what followed
    assert lookup([1, 2, 3, 9, 1, 2, 3], 4, 5, 2) == []  # no run of 4 repeats
    assert lookup([5, 1, 7, 1], 1, 2, 3) == [7, 1]  # the latest "1", then what follows up to the end
    assert lookup([4], 1, 1, 3) == []


def test_config():
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    spec = SpeculativeConfig(method="ngram", prompt_lookup_max=4)
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (4, 4)
    assert SpeculativeConfig.from_value({"method": "ngram", "prompt_lookup_min": 2}).prompt_lookup_max == 2
    with pytest.raises(ValueError, match="prompt_lookup_min=3 exceeds prompt_lookup_max=2"):
        SpeculativeConfig(method="ngram", prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="prompt_lookup_max must be an int >= 1, got 0"):
        SpeculativeConfig(method="ngram", prompt_lookup_min=1, prompt_lookup_max=0)
    with pytest.raises(ValueError, match="apply to method 'ngram' only, not 'mtp'"):
        SpeculativeConfig(method="mtp", prompt_lookup_max=3)


ENGINE = dict(dtype="float32", num_threads=1, num_kv_blocks=64)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny V3 model with no MTP layer (the embedded model's tokenizer on random weights)."""
    return make_checkpoint(tmp_path_factory.mktemp("ngram"), "v3", num_mtp_layers=0)


@pytest.mark.parametrize("k, lookup_max", [(1, 2), (3, 3), (5, 1)])
def test_greedy_tokens_equal_those_without_speculation(checkpoint, k, lookup_max):
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": lookup_max,
            "disable_by_batch_size": None}
    prompts = [[int(t) % 90 + 5 for t in range(40)] * 2, [7, 8, 9, 10, 11]]  # token ids: one repeats, one not
    params = SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)
    plain = LLM(model=checkpoint, **ENGINE).generate(prompts, params)
    llm = LLM(model=checkpoint, speculative_config=spec, **ENGINE)
    drafted = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    stats = llm.engine.spec_decoding_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0  # the repeating prompt drafted, and some landed


def test_mtp_without_a_layer_points_to_ngram(checkpoint):
    with pytest.raises(ValueError, match="needs an MTP layer.*method 'ngram' drafts without one"):
        LLM(model=checkpoint, speculative_config={"method": "mtp"}, **ENGINE)
