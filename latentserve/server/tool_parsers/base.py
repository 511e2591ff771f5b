"""The tool parser interface and its registry."""
from __future__ import annotations

import json
from typing import Callable

from latentserve.engine.reasoning.base import held_back
from latentserve.server.tool_protocol import FunctionCall

_PARSERS: dict[str, type["ToolParser"]] = {}


class ToolParser:
    """Splits output text into (content, calls). `partial`: the output may go on, so only calls already closed are
    returned and a content tail that could start the calls' marker is held back. `tools`: the request's tools (OpenAI's
    dicts), for formats that write arguments untyped and need the schema to type them."""

    def extract_tool_calls(self, text: str, partial: bool = False,
                           tools: list[dict] | None = None) -> tuple[str | None, list[FunctionCall]]:
        raise NotImplementedError


def split_at_calls(text: str, begin: str, partial: bool) -> tuple[str, str]:
    """(the content before the calls' marker `begin`, the text from the marker on); a partial output holds back a
    content tail that could still become the marker."""
    content, marker, calls_text = text.partition(begin)
    if not marker and partial:
        content = content[: len(content) - held_back(content, begin)]
    return content, marker + calls_text


def decode_argument(text: str, is_string: bool) -> object:
    """An argument written as text: the text itself for a string, else its JSON value (the text where it is not
    JSON: a model may write an untyped value raw)."""
    if is_string:
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def register_tool_parser(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    def register(cls: type[ToolParser]) -> type[ToolParser]:
        _PARSERS[name] = cls
        return cls
    return register


def tool_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_tool_parser(name: str) -> type[ToolParser]:
    if name not in _PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; available: {', '.join(tool_parser_names())}")
    return _PARSERS[name]
