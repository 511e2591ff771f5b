"""What renders a conversation into prompt text: the checkpoint's Jinja chat template (chat_template.py) or a chat
encoding built into latentserve that a tokenizer mode chooses (tokenizer_mode.py). Both take the same options and
refuse a `chat_template_kwargs` key they would not read, by the same rule."""
from __future__ import annotations

from typing import Any, Protocol

# Variables latentserve itself gives a renderer: a chat_template_kwargs key may not replace one.
RESERVED = {"messages": "the messages", "tools": "tools", "add_generation_prompt": "add_generation_prompt",
            "bos_token": "the tokenizer's BOS token", "eos_token": "the tokenizer's EOS token",
            "chat_template": "the server's --chat-template", "tokenize": "nothing: rendering never tokenizes"}


class TemplateKwargsError(ValueError):
    """A chat_template_kwargs key the renderer would not read (it would be ignored), or one that would replace what
    latentserve gives it."""


class ChatRenderer(Protocol):
    # How errors name it: "the chat template", "the DeepSeek-V3.2 chat encoding".
    description: str

    def variables(self) -> frozenset[str]:
        """The chat_template_kwargs keys it reads."""
        ...

    def render(self, messages: list[dict], tools: list[dict] | None, *, add_generation_prompt: bool,
               continue_final_message: bool, kwargs: dict[str, Any]) -> str:
        """The prompt text (`render_chat`'s contract); `kwargs` already checked against `variables()`."""
        ...


def check_kwargs(description: str, variables: frozenset[str], kwargs: dict[str, Any]) -> None:
    """TemplateKwargsError naming the first bad key of `kwargs` for a renderer that reads `variables`."""
    for name in kwargs:
        if name in RESERVED:
            raise TemplateKwargsError(f"chat_template_kwargs: {name!r} is set by {RESERVED[name]}, not by "
                                      "chat_template_kwargs")
    unread = sorted(set(kwargs) - variables)
    if unread:
        takes = ", ".join(sorted(variables)) or "none"
        raise TemplateKwargsError(f"chat_template_kwargs: {description} reads no variable "
                                  f"{', '.join(map(repr, unread))} (the variables it reads: {takes})")
