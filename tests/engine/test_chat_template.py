"""`render_chat`'s options against transformers' own `apply_chat_template` on the same templates: the generation
prompt on and off, continuing the last message, and template variables (`chat_template_kwargs`)."""
from dataclasses import replace

import pytest

from latentserve.assets import DEFAULT_MODEL_DIR
from latentserve.engine.chat_renderer import TemplateKwargsError
from latentserve.engine.chat_template import load_chat_template, render_chat, template_variables
from latentserve.engine.detokenizer import load_tokenizer

# DeepSeek-V3.1's shape: thinking on opens <think> after the assistant tag, off closes it at once.
THINKING = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '<|User|>' + m['content'] }}"
            "{% elif m['role'] == 'assistant' %}{{ '<|Assistant|>' + m['content'] + eos_token }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|Assistant|>' }}{% if thinking is defined and thinking %}"
            "{{ '<think>' }}{% else %}{{ '</think>' }}{% endif %}{% endif %}")
# Trims what it writes of each message, as many published templates do.
TRIMMING = ("{% for m in messages %}{{ '<' + m['role'] + '>' + m['content'] | trim + '</' + m['role'] + '>\n' }}"
            "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who begat Enos?"}]
CONTINUE = [{"role": "user", "content": "Who begat Enos?"}, {"role": "assistant", "content": "And Seth "}]

TOKENIZER = load_tokenizer(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


def _ours(template: str | None, messages, **options) -> str:
    tokenizer = TOKENIZER if template is None else replace(TOKENIZER, chat_template=template)
    return render_chat(tokenizer, messages, **options)


def _theirs(hf, template: str | None, messages, add_generation_prompt=True, continue_final_message=False,
            chat_template_kwargs=None) -> str:
    return hf.apply_chat_template(messages, chat_template=template, tokenize=False,
                                  add_generation_prompt=add_generation_prompt,
                                  continue_final_message=continue_final_message, **(chat_template_kwargs or {}))


@pytest.mark.parametrize("template", [None, THINKING, TRIMMING], ids=["embedded", "thinking", "trimming"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_generation_prompt_on_and_off(hf, template, add_generation_prompt):
    ours = _ours(template, CHAT, add_generation_prompt=add_generation_prompt)
    assert ours == _theirs(hf, template, CHAT, add_generation_prompt)


@pytest.mark.parametrize("template", [None, THINKING, TRIMMING], ids=["embedded", "thinking", "trimming"])
@pytest.mark.parametrize("last", ["And Seth ", "And Seth", "  And Seth\n"])
def test_continue_final_message(hf, template, last):
    messages = [CONTINUE[0], {"role": "assistant", "content": last}]
    ours = _ours(template, messages, add_generation_prompt=False, continue_final_message=True)
    assert ours == _theirs(hf, template, messages, False, True)
    assert ours.rstrip().endswith("And Seth")


@pytest.mark.parametrize("thinking", [True, False])
def test_template_variables(hf, thinking):
    ours = _ours(THINKING, CHAT, chat_template_kwargs={"thinking": thinking})
    assert ours == _theirs(hf, THINKING, CHAT, chat_template_kwargs={"thinking": thinking})
    assert ours.endswith("<think>" if thinking else "</think>")
    assert template_variables(THINKING) == {"thinking"}


def test_bad_options_are_named():
    with pytest.raises(TemplateKwargsError, match=r"reads no variable 'enable_thinking' \(the variables it reads: "
                                                  r"thinking\)"):
        _ours(THINKING, CHAT, chat_template_kwargs={"enable_thinking": False})
    with pytest.raises(TemplateKwargsError, match="reads no variable 'thinking' .*reads: none"):
        _ours(TRIMMING, CHAT, chat_template_kwargs={"thinking": True})
    with pytest.raises(TemplateKwargsError, match="'messages' is set by the messages"):
        _ours(THINKING, CHAT, chat_template_kwargs={"messages": []})
    with pytest.raises(ValueError, match="needs add_generation_prompt false"):
        _ours(None, CONTINUE, continue_final_message=True)
    with pytest.raises(ValueError, match="the last message must be the assistant's"):
        _ours(None, CHAT, add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(ValueError, match="no text to continue"):
        _ours(None, [CHAT[1], {"role": "assistant", "content": "  "}], add_generation_prompt=False,
              continue_final_message=True)


def test_a_long_template_on_one_line_is_a_template_not_a_file_name(tmp_path):
    template = "{{ messages[0]['content'] }}" * 20  # longer than the OS lets a file name be
    assert load_chat_template(template) == template
    (tmp_path / "t.jinja").write_text("{{ x }}")
    assert load_chat_template(str(tmp_path / "t.jinja")) == "{{ x }}"
    with pytest.raises(ValueError, match="neither a file nor a jinja2 template"):
        load_chat_template("x" * 300)
