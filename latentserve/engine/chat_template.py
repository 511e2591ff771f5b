"""Chat prompts: the tokenizer config's jinja2 chat template, rendered in a sandbox, or the built-in chat encoding the
tokenizer's mode chose in its place (`render_chat` is the one way in for both)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, NoReturn

import jinja2
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from latentserve.engine.chat_renderer import RESERVED, ChatRenderer, check_kwargs
from latentserve.engine.detokenizer import TokenizerInfo

TEMPLATE = "the chat template"


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


@lru_cache(maxsize=4)
def template_variables(template: str) -> frozenset[str]:
    """The variables a template reads that it does not set itself: those chat_template_kwargs may give."""
    compiled = _compile(template)
    return frozenset(meta.find_undeclared_variables(compiled.environment.parse(template))
                     - compiled.environment.globals.keys() - RESERVED.keys())


def _final_text(messages: list[dict]) -> str:
    """The text of the last message, which continue_final_message continues."""
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError("continue_final_message: the last message must be the assistant's, to continue")
    content = messages[-1].get("content")
    if isinstance(content, list):
        texts = [part.get("text") for part in content if isinstance(part, dict) and part.get("text") is not None]
        content = texts[-1] if texts else None
    if not isinstance(content, str) or not content.strip():
        raise ValueError("continue_final_message: the last message has no text to continue")
    return content


def _cut_after(rendered: str, final: str) -> str:
    """`rendered` up to the end of the final message's text (the template's closing of that message dropped). A
    template that trims the message keeps the trimmed text, one that keeps its spaces keeps those."""
    at = rendered.rfind(final.strip())
    if at < 0:
        raise ValueError("continue_final_message: the chat template does not write the last message's text")
    kept = final.lstrip()
    return rendered[: at + len(kept)] if rendered[at: at + len(kept)] == kept else rendered[: at + len(final.strip())]


@dataclass(frozen=True)
class TemplateRenderer:
    """A Jinja chat template with the tokenizer's BOS and EOS text."""

    template: str
    bos_token: str
    eos_token: str
    description: str = TEMPLATE

    def variables(self) -> frozenset[str]:
        return template_variables(self.template)

    def render(self, messages: list[dict], tools: list[dict] | None, *, add_generation_prompt: bool,
               continue_final_message: bool, kwargs: dict[str, Any]) -> str:
        final = _final_text(messages) if continue_final_message else None
        try:
            rendered = _compile(self.template).render(**kwargs, messages=messages, tools=tools,
                                                      add_generation_prompt=add_generation_prompt,
                                                      bos_token=self.bos_token, eos_token=self.eos_token)
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template failed on these messages: {e}") from e
        return rendered if final is None else _cut_after(rendered, final)


def chat_renderer(tokenizer: TokenizerInfo) -> ChatRenderer | None:
    """What renders this tokenizer's chats: the encoding its mode chose, else its template; None if it has neither."""
    if tokenizer.chat_encoding is not None:
        return tokenizer.chat_encoding
    if not tokenizer.chat_template:
        return None
    return TemplateRenderer(tokenizer.chat_template, _token_text(tokenizer, tokenizer.bos_token_id),
                            _token_text(tokenizer, tokenizer.eos_token_id))


def chat_variables(tokenizer: TokenizerInfo) -> frozenset[str]:
    """The chat_template_kwargs keys this tokenizer's chats take (none without a chat template)."""
    renderer = chat_renderer(tokenizer)
    return renderer.variables() if renderer is not None else frozenset()


def check_chat_kwargs(tokenizer: TokenizerInfo, kwargs: dict[str, Any]) -> None:
    """TemplateKwargsError naming the first key of `kwargs` this tokenizer's chats would not read."""
    renderer = chat_renderer(tokenizer)
    if renderer is None:
        check_kwargs(TEMPLATE, frozenset(), kwargs)
    else:
        check_kwargs(renderer.description, renderer.variables(), kwargs)


def render_chat(tokenizer: TokenizerInfo, messages: list[dict], tools: list[dict] | None = None, *,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """The prompt text of a conversation: ending where the assistant's reply starts (`add_generation_prompt`), where
    the conversation's last message ends, or inside that last (assistant) message, to be continued
    (`continue_final_message`). `chat_template_kwargs`: more variables for the template (e.g. `thinking`).

    ValueError if the model has no chat template (nor encoding), a keyword is not one the renderer reads, or the
    renderer rejects the conversation.
    """
    renderer = chat_renderer(tokenizer)
    if renderer is None:
        raise ValueError("this model has no chat template (tokenizer_config.json chat_template)")
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message continues the last message: it needs add_generation_prompt false")
    kwargs = chat_template_kwargs or {}
    check_kwargs(renderer.description, renderer.variables(), kwargs)
    return renderer.render(messages, tools, add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, kwargs=kwargs)


def chat_prompt_ids(tokenizer: TokenizerInfo, messages: list[dict], tools: list[dict] | None = None,
                    **options: Any) -> list[int]:
    """Token ids of the rendered conversation (`render_chat`'s options); the template writes any BOS itself."""
    return tokenizer.encode(render_chat(tokenizer, messages, tools, **options), add_special_tokens=False)


def with_chat_template(tokenizer: TokenizerInfo, template: str) -> TokenizerInfo:
    """A copy of the tokenizer that renders chats with `template` (already loaded). Refused where a tokenizer mode
    was asked for: its encoding and the template would both claim the chats."""
    if tokenizer.tokenizer_mode != "auto":
        raise ValueError(f"a chat template was given, but tokenizer mode {tokenizer.tokenizer_mode!r} renders chats "
                         "with its own encoding: give one of the two")
    return replace(tokenizer, chat_template=template, chat_encoding=None)


def _is_file(value: str) -> bool:
    # A template on one line can be longer than a file name may be: the OS refuses to look it up (ENAMETOOLONG).
    try:
        return Path(value).is_file()
    except OSError:
        return False


def load_chat_template(value: str) -> str:
    """vLLM's --chat-template: a file's path, or the template itself; ValueError if it is neither or does not
    compile."""
    if _is_file(value):
        template = Path(value).read_text(encoding="utf-8")
    elif any(c in value for c in "{}\n"):
        template = value
    else:
        raise ValueError(f"chat template {value!r} is neither a file nor a jinja2 template")
    try:
        _compile(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template {value!r} does not compile: {e}") from e
    return template
