"""DeepSeek-V3's calls: <｜tool▁calls▁begin｜>, then per call
<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGUMENTS\\n```<｜tool▁call▁end｜>, then <｜tool▁calls▁end｜>."""
from __future__ import annotations

import re

from latentserve.engine.reasoning.base import held_back
from latentserve.server.tool_parsers.base import ToolParser, register_tool_parser
from latentserve.server.tool_protocol import FunctionCall

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
_CALL = re.compile(r"<｜tool▁call▁begin｜>(?P<type>.*?)<｜tool▁sep｜>(?P<name>.*?)\n```json\n(?P<arguments>.*?)\n```"
                   r"<｜tool▁call▁end｜>", re.DOTALL)


@register_tool_parser("deepseek_v3")
class DeepSeekV3ToolParser(ToolParser):
    def extract_tool_calls(self, text: str, partial: bool = False,
                           tools: list[dict] | None = None) -> tuple[str | None, list[FunctionCall]]:
        content, marker, calls_text = text.partition(CALLS_BEGIN)
        if not marker and partial:
            content = content[: len(content) - held_back(content, CALLS_BEGIN)]
        calls = [FunctionCall(name=m["name"].strip(), arguments=m["arguments"].strip())
                 for m in _CALL.finditer(calls_text)]
        return content or None, calls
