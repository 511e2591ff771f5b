"""DeepSeek-V3's calls: <｜tool▁calls▁begin｜>, then per call
<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGUMENTS\\n```<｜tool▁call▁end｜>, then <｜tool▁calls▁end｜>."""
from __future__ import annotations

import re

from latentserve.server.tool_parsers.base import ToolParser, register_tool_parser, split_at_calls
from latentserve.server.tool_protocol import FunctionCall

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
_CALL = re.compile(r"<｜tool▁call▁begin｜>(?P<type>.*?)<｜tool▁sep｜>(?P<name>.*?)\n```json\n(?P<arguments>.*?)\n```"
                   r"<｜tool▁call▁end｜>", re.DOTALL)


@register_tool_parser("deepseek_v3")
class DeepSeekV3ToolParser(ToolParser):
    call = _CALL  # one call, with its `name` and `arguments` groups

    def extract_tool_calls(self, text: str, partial: bool = False,
                           tools: list[dict] | None = None) -> tuple[str | None, list[FunctionCall]]:
        content, calls_text = split_at_calls(text, CALLS_BEGIN, partial)
        calls = [FunctionCall(name=m["name"].strip(), arguments=m["arguments"].strip())
                 for m in self.call.finditer(calls_text)]
        return content or None, calls
