"""An assistant's output text as OpenAI's message and streamed deltas: reasoning split off by the reasoning parser."""
from __future__ import annotations

from latentserve.engine.reasoning import ReasoningParser
from latentserve.server.protocol import AssistantMessage, DeltaMessage


def assistant_message(text: str, reasoning_parser: ReasoningParser | None) -> AssistantMessage:
    if reasoning_parser is None:
        return AssistantMessage(content=text)
    reasoning, content = reasoning_parser.extract_reasoning(text)
    return AssistantMessage(content=content, reasoning_content=reasoning, reasoning=reasoning)


def delta_message(previous_text: str, text: str, finished: bool,
                  reasoning_parser: ReasoningParser | None) -> DeltaMessage | None:
    """What `text` adds to `previous_text` (the output so far); None if nothing yet."""
    if reasoning_parser is None:
        delta = text[len(previous_text):]
        return DeltaMessage(content=delta) if delta else None
    reasoning, content = reasoning_parser.extract_reasoning_streaming(previous_text, text, finished)
    if reasoning is None and content is None:
        return None
    return DeltaMessage(content=content, reasoning_content=reasoning, reasoning=reasoning)
