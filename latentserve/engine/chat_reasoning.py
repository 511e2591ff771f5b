"""An assistant turn's earlier reasoning, sent back in a conversation (interleaved thinking: agents return each turn's
reasoning with its answer and tool calls). Thinking models' templates read it from the message's `reasoning_content`
and decide themselves which turns keep it (GLM, Kimi and DeepSeek-V3.2 keep it only for the turns after the last
user message). `reasoning` is the newer name of the same field: a message may carry either, or both with one text."""
from __future__ import annotations

from typing import Any

REASONING_KEYS = ("reasoning_content", "reasoning")
# Between the pieces of one turn's reasoning that an API sends back apart (Anthropic's thinking blocks, the Responses
# API's reasoning items and their parts): separate thoughts, kept apart in the text as paragraphs.
REASONING_JOIN = "\n\n"


def turn_reasoning(role: Any, reasoning_content: Any, reasoning: Any) -> str | None:
    """The reasoning a message carries under either name, or None. ValueError naming the key at fault where it is not
    text, where a message other than the assistant's carries one (only the model's own turns reasoned), or where
    both names are given with different text."""
    given = {key: value for key, value in zip(REASONING_KEYS, (reasoning_content, reasoning)) if value is not None}
    for key, value in given.items():
        if not isinstance(value, str):
            raise ValueError(f"{key} must be a string, got {type(value).__name__}")
        if role != "assistant":
            raise ValueError(f"{key} is only allowed in assistant messages")
    if len(set(given.values())) > 1:
        raise ValueError("reasoning_content and reasoning differ: they name the same text, send one of them")
    return next(iter(given.values()), None)


def with_reasoning(message: dict[str, Any], reasoning: str | None) -> dict[str, Any]:
    """`message` as a template gets it: its reasoning, if any, under both names, as templates read one or the other."""
    plain = {key: value for key, value in message.items() if key not in REASONING_KEYS}
    return plain if reasoning is None else plain | dict.fromkeys(REASONING_KEYS, reasoning)


def join_reasoning(pieces: list[str]) -> str | None:
    """One turn's reasoning from the pieces an API sent it back in; None if there are none."""
    return REASONING_JOIN.join(pieces) if pieces else None
