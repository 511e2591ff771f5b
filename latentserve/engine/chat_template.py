"""Chat prompts: the tokenizer config's jinja2 chat template, rendered in a sandbox."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from latentserve.engine.detokenizer import TokenizerInfo


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


@lru_cache(maxsize=4)
def _compile(template: str) -> jinja2.Template:
    # The settings Hugging Face chat templates are written for.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)


def _token_text(tokenizer: TokenizerInfo, token_id: int | None) -> str:
    return "" if token_id is None else tokenizer.tokenizer.id_to_token(token_id) or ""


def render_chat(tokenizer: TokenizerInfo, messages: list[dict], tools: list[dict] | None = None) -> str:
    """The prompt text of a conversation, ending where the assistant's reply starts.

    ValueError if the model has no chat template or the template rejects the conversation.
    """
    if not tokenizer.chat_template:
        raise ValueError("this model has no chat template (tokenizer_config.json chat_template)")
    try:
        template = _compile(tokenizer.chat_template)
        return template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=True,
            bos_token=_token_text(tokenizer, tokenizer.bos_token_id),
            eos_token=_token_text(tokenizer, tokenizer.eos_token_id),
        )
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template failed on these messages: {e}") from e


def chat_prompt_ids(tokenizer: TokenizerInfo, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of the rendered conversation; the template writes any BOS itself."""
    return tokenizer.encode(render_chat(tokenizer, messages), add_special_tokens=False)


def load_chat_template(value: str) -> str:
    """vLLM's --chat-template: a file's path, or the template itself; ValueError if it is neither or does not
    compile."""
    path = Path(value)
    if path.is_file():
        template = path.read_text(encoding="utf-8")
    elif any(c in value for c in "{}\n"):
        template = value
    else:
        raise ValueError(f"chat template {value!r} is neither a file nor a jinja2 template")
    try:
        _compile(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template {value!r} does not compile: {e}") from e
    return template
