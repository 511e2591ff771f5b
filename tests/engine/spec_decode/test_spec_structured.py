"""Structured outputs under MTP speculation: greedy choice / JSON / regex outputs are those without speculation (a
grammar's request decodes one token a step; drafting it unmasked would let the drafts break the grammar), while
unconstrained requests in the same batch do speculate."""
from __future__ import annotations

import pytest

from latentserve import LLM, SamplingParams
from latentserve.sampling_params import StructuredOutputsParams
from tests.engine.spec_decode.test_spec_embedded import ENGINE, PROMPTS, SPEC
from tests.engine.structured.schemas import CHOICES, REGEXES, SCHEMAS
from tests.engine.structured.test_structured_outputs import check_output

SPECS = ([StructuredOutputsParams(json=s) for s in SCHEMAS[5:]] + [StructuredOutputsParams(regex=r) for r in REGEXES]
         + [StructuredOutputsParams(choice=c) for c in CHOICES])


@pytest.mark.parametrize("k", [1, 3])
def test_structured_outputs_with_mtp_equal_those_without(k: int) -> None:
    params = ([SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=s) for s in SPECS]
              + [SamplingParams(temperature=0.0, max_tokens=24) for _ in PROMPTS])
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(SPECS))] + PROMPTS
    expected = [o.outputs[0] for o in LLM(**ENGINE).generate(prompts, params)]
    spec = LLM(speculative_config={**SPEC, "num_speculative_tokens": k}, **ENGINE)
    got = [o.outputs[0] for o in spec.generate(prompts, params)]
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    for s, out in zip(SPECS, got):
        assert out.finish_reason == "stop", (s, out.text)
        check_output(s, out.text)
    assert spec.engine.spec_decoding_stats.num_accepted_tokens > 0  # the unconstrained requests speculated
