import pytest

from latentserve.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens, p.min_tokens) == (1, 1.0, 1.0, 0, 16, 0)
    assert p.stop == [] and p.stop_token_ids == [] and not p.is_greedy and not p.top_k_enabled
    assert (p.best_of, p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p) == (None, 0, 0, 1, 0)
    assert p.bad_words == [] and p.logit_bias is None and p.allowed_token_ids is None
    assert p.skip_special_tokens and p.spaces_between_special_tokens and not p.include_stop_str_in_output
    assert p.truncate_prompt_tokens is None and p.num_samples == 1 and not p.uses_penalties
    assert p.detokenize is True


def test_whole_vocabulary_logprobs_and_no_text_without_stop_strings_are_accepted():
    p = SamplingParams(logprobs=-1, prompt_logprobs=-1, detokenize=False, stop_token_ids=[3], bad_words=["x"],
                       include_stop_str_in_output=True)
    assert (p.logprobs, p.prompt_logprobs, p.detokenize) == (-1, -1, False)
    assert [(c.logprobs, c.prompt_logprobs) for c in map(SamplingParams(n=2, logprobs=-1, prompt_logprobs=-1).for_sample,
                                                        range(2))] == [(-1, -1), (-1, None)]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n": 0}, "n must be >= 1"),
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k must be >= -1"),
        ({"top_k": 2.5}, "top_k must be an int"),
        ({"max_tokens": -1}, "max_tokens must be >= 1"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"min_tokens": -1}, "min_tokens must be >= 0"),
        ({"min_tokens": 5, "max_tokens": 4}, r"min_tokens \(5\) must be <= max_tokens \(4\)"),
        ({"seed": -3}, "seed must be >= 0"),
        ({"seed": True}, "seed must be an int"),
        ({"stop": ["ok", ""]}, "non-empty str"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids entry must be >= 0"),
        ({"logprobs": -2}, "logprobs must be >= -1"),
        ({"prompt_logprobs": -5}, "prompt_logprobs must be >= -1"),
        ({"stop": "end", "detokenize": False}, r"stop strings \['end'\] need detokenize=True"),
        ({"detokenize": 0}, "detokenize must be a bool"),
        ({"prompt_logprobs": 1.0}, "prompt_logprobs must be an int"),
        ({"n": 3, "best_of": 2}, "best_of must be >= n"),
        ({"best_of": 0}, "best_of must be >= 1"),
        ({"min_p": 5}, r"min_p must be in \[0.0, 1.0\]"),
        ({"min_p": -0.1}, "min_p must be in"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2.0, 2.0\]"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in"),
        ({"frequency_penalty": float("inf")}, "frequency_penalty must be a finite number"),
        ({"repetition_penalty": 0}, r"repetition_penalty must be in \(0.0"),
        ({"repetition_penalty": -1.0}, "repetition_penalty must be in"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias token id must be an int"),
        ({"logit_bias": {-4: 1.0}}, "logit_bias token id must be >= 0"),
        ({"logit_bias": {4: float("nan")}}, r"logit_bias\[4\] must be a finite number"),
        ({"logit_bias": [1, 2]}, "logit_bias must be a dict"),
        ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
        ({"allowed_token_ids": [1, -2]}, "allowed_token_ids entry must be >= 0"),
        ({"bad_words": ["ok", " "]}, "bad_words entry must be a non-blank str"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be >= 1 or -1"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens must be >= -1"),
        ({"include_stop_str_in_output": 1}, "include_stop_str_in_output must be a bool"),
        ({"spaces_between_special_tokens": None}, "spaces_between_special_tokens must be a bool"),
    ],
)
def test_invalid_values_name_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_normalization():
    p = SamplingParams(temperature=0, stop="END", stop_token_ids=(5, 6), top_k=-1, max_tokens=None)
    assert p.is_greedy and p.stop == ["END"] and p.stop_token_ids == [5, 6] and not p.top_k_enabled
    assert p.max_tokens is None
    assert SamplingParams(top_k=3).top_k_enabled


def test_logit_bias_keys_from_json_and_clamped_like_vllm():
    p = SamplingParams(logit_bias={"7": 250, 3: -1e9, 5: 0.5})
    assert p.logit_bias == {7: 100.0, 3: -100.0, 5: 0.5}


def test_token_ids_checked_against_the_vocabulary_name_the_field():
    SamplingParams(logit_bias={9: 1.0}, allowed_token_ids=[9], stop_token_ids=[9]).validate_for_vocab(10)
    for kwargs, field in [({"logit_bias": {10: 1.0}}, "logit_bias"), ({"allowed_token_ids": [3, 12]}, "allowed_token_ids"),
                          ({"stop_token_ids": [10]}, "stop_token_ids")]:
        with pytest.raises(ValueError, match=f"{field} has token ids \\[1[02]\\] outside the vocabulary"):
            SamplingParams(**kwargs).validate_for_vocab(10)


def test_parallel_samples_get_derived_seeds():
    p = SamplingParams(n=2, best_of=3, seed=10, temperature=0.7)
    assert p.num_samples == 3
    children = [p.for_sample(i) for i in range(3)]
    assert [c.seed for c in children] == [10, 11, 12]
    assert all(c.n == 1 and c.best_of is None and c.temperature == 0.7 for c in children)
    # best_of > n ranks samples by cumulative logprob: each sample tracks its tokens' logprobs.
    assert all(c.logprobs == 0 for c in children)
    assert SamplingParams(n=2).for_sample(1).seed is None
    assert SamplingParams(n=2).for_sample(1).logprobs is None
    # Only the first sample scores the prompt (the others start on its blocks).
    with_prompt = SamplingParams(n=2, prompt_logprobs=3, logprobs=2)
    assert [(c.prompt_logprobs, c.logprobs) for c in map(with_prompt.for_sample, range(2))] == [(3, 2), (None, 2)]
