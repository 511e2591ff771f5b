"""LLM.generate takes vLLM's prompt forms and its use_tqdm switch (the embedded model)."""
from __future__ import annotations

import pytest

from latentserve import LLM, SamplingParams, TextPrompt, TokensPrompt

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
TEXT = "And God said"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_num_seqs=4, num_kv_blocks=64, dtype="float32")


def _summary(outputs):
    return [(o.prompt, o.prompt_token_ids, o.outputs[0].token_ids) for o in outputs]


def test_prompt_dicts_run_as_text_and_ids(llm):
    ids = llm.get_tokenizer().encode(TEXT)
    plain = llm.generate([TEXT, ids], GREEDY, use_tqdm=False)
    forms = llm.generate([TextPrompt(prompt=TEXT), {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert _summary(forms) == _summary(plain)
    assert forms[0].prompt == TEXT and forms[1].prompt is None  # as vLLM: a TokensPrompt has no text
    assert _summary(llm.generate(TokensPrompt(prompt_token_ids=ids), GREEDY, use_tqdm=False)) == _summary(plain[1:])
    assert _summary(llm.generate({"prompt": TEXT}, GREEDY, use_tqdm=False)) == _summary(plain[:1])


@pytest.mark.parametrize("prompt, message", [
    ({"prompt": TEXT, "multi_modal_data": {}}, r"\['multi_modal_data'\] are not supported"),
    ({"prompt_token_ids": [1, 2], "cache_salt": "x"}, r"\['cache_salt'\] are not supported"),
    ({"prompt": TEXT, "prompt_token_ids": [1, 2]}, "exactly one of 'prompt'"),
    ({}, "got neither"),
    ({"prompt": [1, 2]}, "'prompt' must be a str, got list"),
    ({"prompt_token_ids": "12"}, "'prompt_token_ids' must be a list, got str"),
])
def test_bad_prompt_dicts_are_refused_by_name(llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([TEXT, prompt], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # nothing ran: every prompt is checked first


def test_progress_bar_counts_finished_requests_on_stderr(llm, capsys):
    llm.generate([TEXT] * 3, GREEDY)
    captured = capsys.readouterr()
    assert captured.out == "" and "Processed prompts" in captured.err and "3/3" in captured.err
    llm.generate([TEXT] * 3, GREEDY, use_tqdm=False)
    assert capsys.readouterr().err == ""


def test_keywords_not_implemented_are_refused(llm):
    with pytest.raises(TypeError, match="lora_request"):
        llm.generate(TEXT, GREEDY, lora_request=None)
