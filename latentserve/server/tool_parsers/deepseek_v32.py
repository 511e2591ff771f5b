"""DeepSeek-V3.2's calls in its DSML markup, as its encoding writes them: <｜DSML｜function_calls>, per call
<｜DSML｜invoke name="NAME">, per argument <｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>,
then </｜DSML｜invoke>, and </｜DSML｜function_calls> (newlines between the tags). A value marked string="true" is the
text itself, any other is JSON."""
from __future__ import annotations

import json
import re

from latentserve.server.tool_parsers.base import ToolParser, decode_argument, register_tool_parser, split_at_calls
from latentserve.server.tool_protocol import FunctionCall

CALLS_BEGIN = "<｜DSML｜function_calls>"
_INVOKE = re.compile(r'<｜DSML｜invoke name="(?P<name>[^"]*)">(?P<arguments>.*?)</｜DSML｜invoke>', re.DOTALL)
_PARAMETER = re.compile(r'<｜DSML｜parameter name="(?P<key>[^"]*)" string="(?P<string>true|false)">(?P<value>.*?)'
                        r'</｜DSML｜parameter>', re.DOTALL)


def _call(name: str, arguments_text: str) -> FunctionCall:
    arguments = {m["key"]: decode_argument(m["value"], m["string"] == "true") for m in _PARAMETER.finditer(arguments_text)}
    return FunctionCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False))


@register_tool_parser("deepseek_v32")
class DeepSeekV32ToolParser(ToolParser):
    def extract_tool_calls(self, text: str, partial: bool = False,
                           tools: list[dict] | None = None) -> tuple[str | None, list[FunctionCall]]:
        content, calls_text = split_at_calls(text, CALLS_BEGIN, partial)
        calls = [_call(m["name"], m["arguments"]) for m in _INVOKE.finditer(calls_text)]
        return content or None, calls
