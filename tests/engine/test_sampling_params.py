import pytest

from latentserve.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens, p.min_tokens) == (1, 1.0, 1.0, 0, 16, 0)
    assert p.stop == [] and p.stop_token_ids == [] and not p.is_greedy and not p.top_k_enabled


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n": 2}, "n=2 is not supported"),
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
        ({"logprobs": -1}, "logprobs must be >= 0"),
        ({"prompt_logprobs": 1.0}, "prompt_logprobs must be an int"),
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
