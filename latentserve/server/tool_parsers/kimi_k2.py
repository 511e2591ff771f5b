"""Kimi K2's calls: <|tool_calls_section_begin|>, then per call
<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>ARGUMENTS<|tool_call_end|>, then
<|tool_calls_section_end|>. The call id names the function as `functions.NAME:INDEX`."""
from __future__ import annotations

import re

from latentserve.server.tool_parsers.base import ToolParser, register_tool_parser, split_at_calls
from latentserve.server.tool_protocol import FunctionCall

SECTION_BEGIN = "<|tool_calls_section_begin|>"
_CALL = re.compile(r"<\|tool_call_begin\|>\s*(?P<id>[^<]*?):\d+\s*<\|tool_call_argument_begin\|>\s*"
                   r"(?P<arguments>.*?)\s*<\|tool_call_end\|>", re.DOTALL)


def _name(call_id: str) -> str:
    """`functions.get_weather` -> `get_weather`."""
    return call_id.strip().removeprefix("functions.")


@register_tool_parser("kimi_k2")
class KimiK2ToolParser(ToolParser):
    def extract_tool_calls(self, text: str, partial: bool = False,
                           tools: list[dict] | None = None) -> tuple[str | None, list[FunctionCall]]:
        content, calls_text = split_at_calls(text, SECTION_BEGIN, partial)
        calls = [FunctionCall(name=_name(m["id"]), arguments=m["arguments"]) for m in _CALL.finditer(calls_text)]
        return content or None, calls
