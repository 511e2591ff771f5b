"""`LLM.chat`'s conversations, as vLLM takes them, made into prompts with the model's chat template."""
from __future__ import annotations

from typing import Any

from latentserve.engine.chat_reasoning import turn_reasoning, with_reasoning
from latentserve.engine.chat_template import load_chat_template, render_chat, with_chat_template
from latentserve.engine.detokenizer import TokenizerInfo

Conversation = list[dict[str, Any]]  # OpenAI's messages: {"role": ..., "content": ...}, oldest first
ROLES = ("assistant", "developer", "system", "tool", "user")  # the server's (protocol.ChatMessage)


def conversations_of(messages: Conversation | list[Conversation]) -> list[Conversation]:
    """One conversation, or a batch of them (a list of message lists), as a batch."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of messages, or a list of such lists")
    return messages if all(isinstance(m, list) for m in messages) else [messages]


def _content_text(index: int, content: Any) -> str:
    """A message's text: its string, or its OpenAI text parts joined (as the server joins them)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ValueError(f"message {index}: content must be a string or a list of text parts, "
                         f"got {type(content).__name__}")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"message {index}: content part type {kind!r} is not supported: only "
                             "{'type': 'text', 'text': ...} parts")
        texts.append(part["text"])
    return "".join(texts)


def _message(index: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise ValueError(f"message {index} must be a dict with 'role' and 'content', got {type(message).__name__}")
    role = message.get("role")
    if role not in ROLES:
        raise ValueError(f"message {index}: role {role!r} is not one of {', '.join(ROLES)}")
    try:
        reasoning = turn_reasoning(role, message.get("reasoning_content"), message.get("reasoning"))
    except ValueError as e:
        raise ValueError(f"message {index}: {e}") from None
    return with_reasoning({**message, "content": _content_text(index, message.get("content"))}, reasoning)


def chat_tokenizer(tokenizer: TokenizerInfo | None, chat_template: str | None) -> TokenizerInfo:
    """The tokenizer to render with: the engine's, or a copy with `chat_template` (a template or its file's path)
    in place of the model's, so that the engine's own stays as it is for other calls."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer, and this model has none (pass token ids to generate instead)")
    return tokenizer if chat_template is None else with_chat_template(tokenizer, load_chat_template(chat_template))


def render_conversation(tokenizer: TokenizerInfo, conversation: Conversation, tools: list[dict] | None,
                        **options: Any) -> tuple[str, list[int]]:
    """The prompt text of one conversation (`render_chat`'s options) and its token ids, tokenized as
    `chat_prompt_ids` does: the template writes any BOS itself."""
    text = render_chat(tokenizer, [_message(i, m) for i, m in enumerate(conversation)], tools, **options)
    return text, tokenizer.encode(text, add_special_tokens=False)
