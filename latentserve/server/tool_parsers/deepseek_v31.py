"""DeepSeek-V3.1's calls (and V3.2-Exp's, whose template kept them), as its chat template writes them:
<｜tool▁calls▁begin｜>, then per call <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>, then
<｜tool▁calls▁end｜>: the arguments as JSON, without V3's `function` type and code fence."""
from __future__ import annotations

import re

from latentserve.engine.reasoning.base import held_back
from latentserve.server.tool_parsers.base import ToolParser, register_tool_parser
from latentserve.server.tool_parsers.deepseek_v3 import CALLS_BEGIN
from latentserve.server.tool_protocol import FunctionCall

_CALL = re.compile(r"<｜tool▁call▁begin｜>(?P<name>.*?)<｜tool▁sep｜>(?P<arguments>.*?)<｜tool▁call▁end｜>", re.DOTALL)


@register_tool_parser("deepseek_v31")
class DeepSeekV31ToolParser(ToolParser):
    def extract_tool_calls(self, text: str, partial: bool = False,
                           tools: list[dict] | None = None) -> tuple[str | None, list[FunctionCall]]:
        content, marker, calls_text = text.partition(CALLS_BEGIN)
        if not marker and partial:
            content = content[: len(content) - held_back(content, CALLS_BEGIN)]
        calls = [FunctionCall(name=m["name"].strip(), arguments=m["arguments"].strip())
                 for m in _CALL.finditer(calls_text)]
        return content or None, calls
