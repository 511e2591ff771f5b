"""Structured outputs on the embedded model: every output matches its spec and ends with "stop", in every engine mode,
and greedy constrained decoding equals a naive per-request loop over transformers with a fresh matcher per token."""
import json
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr

from latentserve import LLM, SamplingParams
from latentserve.assets import DEFAULT_MODEL_DIR
from latentserve.engine.detokenizer import load_tokenizer
from latentserve.engine.structured import grammar_bitmask
from latentserve.engine.structured.backend import build_grammar, tokenizer_info
from latentserve.sampling_params import StructuredOutputsParams
from tests.engine.structured.schemas import CHOICES, REGEXES, SCHEMAS

PROMPT = "And God said"
SPECS = ([StructuredOutputsParams(json=s) for s in SCHEMAS] + [StructuredOutputsParams(regex=r) for r in REGEXES]
         + [StructuredOutputsParams(choice=c) for c in CHOICES])


def check_output(spec: StructuredOutputsParams, text: str) -> None:
    if spec.json is not None:
        jsonschema.validate(json.loads(text), spec.json)
        assert not re.search(r"\s", _outside_strings(text)), text  # compact by default
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, text), (spec.regex, text)
    else:
        assert text in spec.choice


def _outside_strings(text: str) -> str:
    return re.sub(r'"(\\.|[^"\\])*"', '""', text)


def generate(llm: LLM, temperature: float = 0.0, prompt: str = PROMPT, specs=SPECS, **kwargs):
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=120, structured_outputs=s, **kwargs)
              for i, s in enumerate(specs)]
    return llm.generate([prompt] * len(specs), params)


def assert_all_valid(outputs, specs=SPECS) -> None:
    for spec, out in zip(specs, outputs):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", (spec, completion.text)
        check_output(spec, completion.text)


@pytest.fixture(scope="module")
def baseline():
    """Greedy outputs with DBO off, no prefix caching, plenty of KV blocks."""
    outputs = generate(LLM(dtype="float32", max_num_seqs=64, enable_prefix_caching=False))
    assert_all_valid(outputs)
    return [o.outputs[0].token_ids for o in outputs]


def test_sampled_outputs_validate():
    assert_all_valid(generate(LLM(dtype="float32", max_num_seqs=64), temperature=1.0, top_p=0.95))


def test_greedy_matches_naive_loop_over_transformers(baseline):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(DEFAULT_MODEL_DIR)
    vocab_size = model.config.vocab_size
    info = tokenizer_info(tokenizer.tokenizer, vocab_size, [tokenizer.eos_token_id])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    prompt = tokenizer.encode(PROMPT)
    # A JSON schema with nesting and $ref, a regex and a choice list.
    for index in (16, len(SCHEMAS) + 2, len(SCHEMAS) + len(REGEXES) + 1):
        compiled = compiler.compile_grammar(build_grammar(SPECS[index]))
        tokens: list[int] = []
        while True:
            matcher = xgr.GrammarMatcher(compiled)  # fresh each token: replays the whole output
            for t in tokens:
                assert matcher.accept_token(t)
            if matcher.is_terminated():
                break
            bitmask = xgr.allocate_token_bitmask(1, vocab_size)
            matcher.fill_next_token_bitmask(bitmask)
            allowed = torch.tensor([(bitmask[0, i // 32].item() >> (i % 32)) & 1 for i in range(vocab_size)]).bool()
            with torch.no_grad():
                logits = model(torch.tensor([prompt + tokens])).logits[0, -1]
            tokens.append(int(logits.masked_fill(~allowed, float("-inf")).argmax()))
        assert baseline[index] == tokens, SPECS[index]


@pytest.mark.parametrize("mode", ["dbo", "prefix_caching", "preemption"])
def test_same_outputs_in_every_engine_mode(baseline, mode):
    kwargs = {
        "dbo": dict(enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=2),
        "prefix_caching": dict(enable_prefix_caching=True, block_size=2),
        # 16 blocks of 16 tokens: all requests at once do not fit, so the newest are preempted and recomputed.
        "preemption": dict(num_kv_blocks=16, max_model_len=256, max_num_batched_tokens=256),
    }[mode]
    llm = LLM(dtype="float32", max_num_seqs=64, **kwargs)
    scheduler = llm.engine.scheduler
    preempted = []
    original = scheduler._preempt
    scheduler._preempt = lambda request: (preempted.append(request.request_id), original(request))
    if mode == "prefix_caching":
        generate(llm)  # fills the cache
    outputs = generate(llm)
    assert_all_valid(outputs)
    assert [o.outputs[0].token_ids for o in outputs] == baseline
    if mode == "prefix_caching":
        assert all(o.num_cached_tokens > 0 for o in outputs)
    if mode == "preemption":
        assert preempted


def test_unlikely_only_completion_still_completes():
    """No dead ends: the grammar's only path needs tokens the model would never pick."""
    llm = LLM(dtype="float32")
    specs = [StructuredOutputsParams(regex=r"§¤\{QQ\}~~"), StructuredOutputsParams(json={"const": "zxq%$#&ÆØ"})]
    outputs = llm.generate([PROMPT] * 2, [SamplingParams(temperature=0, max_tokens=60, structured_outputs=s)
                                         for s in specs])
    assert outputs[0].outputs[0].text == "§¤{QQ}~~"
    assert json.loads(outputs[1].outputs[0].text) == "zxq%$#&ÆØ"
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs)


def test_json_object_and_flexible_whitespace():
    llm = LLM(dtype="float32")
    tokenizer = llm.engine.tokenizer
    quote = tokenizer.encode('"', add_special_tokens=False)[0]
    close = tokenizer.encode("}", add_special_tokens=False)[0]
    # The bias closes strings and the object as soon as the grammar allows: the small model ends the object.
    params = SamplingParams(temperature=0, max_tokens=60, logit_bias={quote: 30, close: 30},
                            structured_outputs=StructuredOutputsParams(json_object=True))
    out = llm.generate([PROMPT], params)[0].outputs[0]
    assert isinstance(json.loads(out.text), dict) and out.finish_reason == "stop"
    # Flexible whitespace allows a newline after "{" (this small model then pads with whitespace forever); compact not.
    newline = tokenizer.encode("\n", add_special_tokens=False)[0]
    for compact in (True, False):
        state = llm.engine.structured_outputs.new_request(
            StructuredOutputsParams(json=SCHEMAS[9], disable_any_whitespace=compact))
        state.grammar.result()
        assert state.sync(tokenizer.encode("{", add_special_tokens=False))
        bitmask = grammar_bitmask([state], llm.engine.model.config.vocab_size)
        assert bool((bitmask[0, newline // 32].item() >> (newline % 32)) & 1) is not compact


def test_grammar_ends_the_request_under_ignore_eos_and_samples_keep_their_own_matchers():
    llm = LLM(dtype="float32")
    spec = StructuredOutputsParams(choice=["yea", "nay", "amen"])
    out = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=0, n=4, ignore_eos=True, max_tokens=20,
                                                structured_outputs=spec))[0]
    assert len(out.outputs) == 4
    for completion in out.outputs:
        assert completion.text in spec.choice and completion.finish_reason == "stop"


@pytest.mark.parametrize("spec, message", [
    (dict(json={"type": "object", "properties": {"a": {"type": "frobnicate"}}}), 'Unsupported type "frobnicate"'),
    (dict(json="{not json"), "structured_outputs.json"),
    (dict(json={"$ref": "#/$defs/missing"}), "missing"),
    (dict(json={"type": "integer", "minimum": 5, "maximum": 1}), "minimum greater than maximum"),
    (dict(regex="(?<=a)b"), "Lookbehind is not supported"),
    (dict(regex="(a)\\1"), "Backreference is not supported"),
    (dict(grammar="root ::= undefined_rule"), 'Rule "undefined_rule" is not defined'),
])
def test_bad_spec_is_a_value_error_naming_the_problem(spec, message):
    llm = LLM(dtype="float32")
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.generate([PROMPT], SamplingParams(structured_outputs=StructuredOutputsParams(**spec)))
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs, message", [
    (dict(choice=[]), "choice must not be empty"),
    (dict(choice=["a", ""]), "non-empty strings"),
    (dict(), "exactly one of"),
    (dict(regex="a", choice=["a"]), "got regex, choice"),
    (dict(regex=""), "regex must be a non-empty string"),
])
def test_malformed_params_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_min_tokens_is_refused_with_structured_outputs():
    with pytest.raises(ValueError, match="min_tokens cannot be combined with structured_outputs"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))


def test_unknown_field_in_dict_is_refused():
    with pytest.raises(ValueError, match=r"unsupported fields \['whitespace_pattern'\]"):
        SamplingParams(structured_outputs={"regex": "a", "whitespace_pattern": " "})


def test_data_parallel_ranks_constrain_their_own_requests(baseline):
    """Each rank runs the same engine path: greedy outputs equal one process's."""
    llm = LLM(dtype="float32", data_parallel_size=2, enable_expert_parallel=True, max_num_seqs=64, enable_prefix_caching=False)
    specs = SPECS[::5]
    try:
        outputs = generate(llm, specs=specs)
    finally:
        llm.shutdown()
    assert_all_valid(outputs, specs)
    assert [o.outputs[0].token_ids for o in outputs] == baseline[::5]
