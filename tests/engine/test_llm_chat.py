"""LLM.chat: prompts rendered as transformers renders the same chat templates, greedy replies equal to generate
on those prompts' ids, batches of conversations, and refusals by name."""
from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from latentserve import LLM, SamplingParams
from latentserve.assets import DEFAULT_MODEL_DIR
from tests.glm_style_template import CONVERSATION, GLM_STYLE_TEMPLATE, renamed

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ENGINE = dict(max_num_seqs=4, num_kv_blocks=64, dtype="float32")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who said, Let there be light?"}]
REPLY = CHAT + [{"role": "assistant", "content": "God said"}]
# A template of our own: it reads a `thinking` variable, as reasoning models' templates do.
THINKING_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% if thinking %}<think>{% else %}</think>{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(**ENGINE)


@pytest.fixture(scope="module")
def thinking_dir(tmp_path_factory):
    """The embedded checkpoint, copied, with THINKING_TEMPLATE as its chat template."""
    path = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(DEFAULT_MODEL_DIR, path)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": THINKING_TEMPLATE}))
    return path


def _hf_render(model_dir, messages, **options) -> str:
    return AutoTokenizer.from_pretrained(model_dir).apply_chat_template(messages, tokenize=False, **options)


@pytest.mark.parametrize("messages, options", [
    (CHAT, dict(add_generation_prompt=True)),
    (CHAT, dict(add_generation_prompt=False)),
    (REPLY, dict(add_generation_prompt=False, continue_final_message=True)),
])
def test_embedded_model_renders_as_transformers(llm, messages, options):
    out = llm.chat(messages, GREEDY, use_tqdm=False, **options)[0]
    assert out.prompt == _hf_render(DEFAULT_MODEL_DIR, messages, **options)


@pytest.mark.parametrize("thinking", [True, False])
def test_template_variables_render_as_transformers(thinking_dir, thinking):
    llm = LLM(model=thinking_dir, **ENGINE)
    out = llm.chat(CHAT, GREEDY, use_tqdm=False, chat_template_kwargs={"thinking": thinking})[0]
    want = _hf_render(thinking_dir, CHAT, add_generation_prompt=True, thinking=thinking)
    assert out.prompt == want and want.endswith("<think>" if thinking else "</think>")


def test_chat_template_argument_replaces_the_models_for_that_call(llm):
    out = llm.chat(CHAT, GREEDY, use_tqdm=False, chat_template=THINKING_TEMPLATE,
                   chat_template_kwargs={"thinking": True})[0]
    assert out.prompt == AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR).apply_chat_template(
        CHAT, chat_template=THINKING_TEMPLATE, tokenize=False, add_generation_prompt=True, thinking=True)
    assert llm.chat(CHAT, GREEDY, use_tqdm=False)[0].prompt == _hf_render(DEFAULT_MODEL_DIR, CHAT,
                                                                          add_generation_prompt=True)


def test_greedy_reply_equals_generate_on_the_prompt_ids(llm):
    hf = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    cases = [(CHAT, dict(add_generation_prompt=True)),
             (REPLY, dict(add_generation_prompt=False, continue_final_message=True))]
    for messages, options in cases:
        ids = hf(_hf_render(DEFAULT_MODEL_DIR, messages, **options), add_special_tokens=False)["input_ids"]
        want = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
        got = llm.chat(messages, GREEDY, use_tqdm=False, **options)[0]
        assert got.prompt_token_ids == ids
        assert (got.outputs[0].token_ids, got.outputs[0].text) == (want.outputs[0].token_ids, want.outputs[0].text)


def test_a_batch_of_conversations_gets_one_reply_each(llm):
    other = [{"role": "user", "content": [{"type": "text", "text": "In the "}, {"type": "text", "text": "beginning"}]}]
    joined = [{"role": "user", "content": "In the beginning"}]
    outputs = llm.chat([CHAT, other], GREEDY, use_tqdm=False)
    singles = [llm.chat(CHAT, GREEDY, use_tqdm=False)[0], llm.chat(joined, GREEDY, use_tqdm=False)[0]]
    assert len(outputs) == 2
    assert [(o.prompt, o.outputs[0].token_ids) for o in outputs] == [(o.prompt, o.outputs[0].token_ids)
                                                                      for o in singles]


@pytest.mark.parametrize("messages, options, message", [
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], {},
     "message 0: content part type 'image_url' is not supported"),
    ([{"role": "robot", "content": "hi"}], {}, "message 0: role 'robot' is not one of"),
    (CHAT, dict(add_generation_prompt=False, continue_final_message=True), "the last message must be the assistant's"),
    (CHAT, dict(chat_template_kwargs={"enable_thinking": True}), "reads no variable 'enable_thinking'"),
    ([], {}, "messages must be a non-empty list"),
])
def test_bad_conversations_are_refused_by_name(llm, messages, options, message):
    with pytest.raises(ValueError, match=message):
        llm.chat(messages, GREEDY, use_tqdm=False, **options)


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning"])
def test_assistant_reasoning_reaches_the_template_as_transformers_renders_it(llm, key):
    out = llm.chat(renamed(CONVERSATION, key), GREEDY, use_tqdm=False, chat_template=GLM_STYLE_TEMPLATE)[0]
    want = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR).apply_chat_template(
        CONVERSATION, chat_template=GLM_STYLE_TEMPLATE, tokenize=False, add_generation_prompt=True)
    assert out.prompt == want
    assert "<think>r2</think>" in want and "r1" not in want  # the template's own rule: earlier reasoning dropped


@pytest.mark.parametrize("message, error", [
    ({"role": "user", "content": "hi", "reasoning_content": "r"},
     "message 0: reasoning_content is only allowed in assistant messages"),
    ({"role": "assistant", "content": "a", "reasoning_content": "r", "reasoning": "s"},
     "message 0: reasoning_content and reasoning differ"),
    ({"role": "assistant", "content": "a", "reasoning": 3}, "message 0: reasoning must be a string, got int"),
])
def test_bad_reasoning_is_refused_by_name(llm, message, error):
    with pytest.raises(ValueError, match=error):
        llm.chat([message], GREEDY, use_tqdm=False, add_generation_prompt=False, chat_template=GLM_STYLE_TEMPLATE)
