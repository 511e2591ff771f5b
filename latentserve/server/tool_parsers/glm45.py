"""GLM-4.5 / 4.6 / 4.7 / 5 calls, as their chat templates write them: per call
<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n...</tool_call> (4.7 and later drop the
newlines). A string VALUE is written raw, any other as JSON, so the request's schema says which one to decode."""
from __future__ import annotations

import json
import re

from latentserve.server.tool_parsers.base import ToolParser, decode_argument, register_tool_parser, split_at_calls
from latentserve.server.tool_protocol import FunctionCall

CALL_BEGIN = "<tool_call>"
_CALL = re.compile(r"<tool_call>(?P<name>.*?)(?P<arguments>(?:<arg_key>.*?)?)</tool_call>", re.DOTALL)
_ARGUMENT = re.compile(r"<arg_key>(?P<key>.*?)</arg_key>\s*<arg_value>(?P<value>.*?)</arg_value>", re.DOTALL)


def _string_keys(tools: list[dict] | None, name: str) -> set[str]:
    """The parameters of tool `name` whose schema type is (or allows) a string."""
    for tool in tools or []:
        function = tool.get("function", {})
        if function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties", {})
            return {key for key, schema in properties.items() if _allows_string(schema.get("type"))}
    return set()


def _allows_string(kind: object) -> bool:
    return kind == "string" or (isinstance(kind, list) and "string" in kind)


def _call(name: str, arguments_text: str, tools: list[dict] | None) -> FunctionCall:
    strings = _string_keys(tools, name)
    arguments = {m["key"].strip(): decode_argument(m["value"], m["key"].strip() in strings)
                 for m in _ARGUMENT.finditer(arguments_text)}
    return FunctionCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False))


@register_tool_parser("glm45")
class GLM45ToolParser(ToolParser):
    def extract_tool_calls(self, text: str, partial: bool = False,
                           tools: list[dict] | None = None) -> tuple[str | None, list[FunctionCall]]:
        content, calls_text = split_at_calls(text, CALL_BEGIN, partial)
        calls = [_call(m["name"].strip(), m["arguments"], tools) for m in _CALL.finditer(calls_text)]
        return content or None, calls
