"""vLLM's `LLM(...)` keywords without a counterpart: refused with the reason, accepted at the values that mean what
latentserve does, or accepted as no-ops with a note; the same table as `vllm serve`'s flags."""
import logging

import pytest

from latentserve import LLM, SamplingParams
from latentserve.engine.vllm_options import OPTIONS, split_vllm_kwargs



def _refused_values(option) -> list:
    """A switch takes only booleans; an option with a value no boolean, and no number it does not accept."""
    if not option.takes_value:
        return [1, "yes"] + [b for b in (True, False) if b not in option.accepted]
    return [True] + [v for v in (0, 1, 0.5, 8) if v not in option.accepted]


REFUSED = [(option, value) for option in OPTIONS for value in _refused_values(option)]


@pytest.mark.parametrize("option, value", REFUSED, ids=lambda x: getattr(x, "keyword", repr(x)))
def test_refused_with_the_reason(option, value):
    with pytest.raises(ValueError) as info:
        LLM(**{option.keyword: value})  # refused before any model is read
    assert str(info.value) == f"LLM({option.keyword}={value!r}): {option.reason}"


@pytest.mark.parametrize("option", [o for o in OPTIONS if o.accepted], ids=lambda o: o.keyword)
def test_accepted_values_leave_the_engine_settings_alone(option, caplog):
    for value in option.accepted:
        with caplog.at_level(logging.WARNING, logger="latentserve.engine.vllm_options"):
            assert split_vllm_kwargs({option.keyword: value, "max_model_len": 64}) == {"max_model_len": 64}
        noted = [r.getMessage() for r in caplog.records]
        assert noted == ([f"LLM({option.keyword}={value!r}): {option.reason}"] if option.note and value else [])
        caplog.clear()


def test_a_vllm_script_line_runs(caplog):
    """vLLM's usual offline line: the same greedy tokens as without its options."""
    vllm_line = dict(tensor_parallel_size=1, trust_remote_code=True, enforce_eager=True, swap_space=0)
    params = SamplingParams(temperature=0, max_tokens=8)
    with caplog.at_level(logging.WARNING, logger="latentserve.engine.vllm_options"):
        ours = LLM(max_model_len=256, **vllm_line).generate("And God said", params)[0].outputs[0].token_ids
    assert ours == LLM(max_model_len=256).generate("And God said", params)[0].outputs[0].token_ids
    assert sorted(r.getMessage().split(")")[0] for r in caplog.records) == ["LLM(enforce_eager=True",
                                                                           "LLM(trust_remote_code=True"]
