"""DeepSeek-V3.1's calls (and V3.2-Exp's, whose template kept them), as its chat template writes them:
<｜tool▁calls▁begin｜>, then per call <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>, then
<｜tool▁calls▁end｜>: V3's tokens, the arguments as JSON without V3's `function` type and code fence."""
from __future__ import annotations

import re

from latentserve.server.tool_parsers.base import register_tool_parser
from latentserve.server.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser


@register_tool_parser("deepseek_v31")
class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    call = re.compile(r"<｜tool▁call▁begin｜>(?P<name>.*?)<｜tool▁sep｜>(?P<arguments>.*?)<｜tool▁call▁end｜>", re.DOTALL)
