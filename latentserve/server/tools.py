"""How a chat request uses its tools: the mode its tool_choice asks for, and for `required` and a named function the
structured output that enforces it (as vLLM: JSON that must parse), bounded so that a small model always ends it."""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass

from latentserve.server.protocol import ChatCompletionRequest
from latentserve.server.tool_parsers import ToolParser
from latentserve.server.tool_protocol import FunctionCall, NamedToolChoice
from latentserve.structured_params import StructuredOutputsParams

# tool_choice "required": at most this many calls (an unbounded array lets a small model repeat a call forever).
MAX_CALLS = 3
# String arguments without a bound of their own end within this many characters (a small model rarely closes a string
# by itself), arrays within this many items.
MAX_STRING_LENGTH = 64
MAX_ARRAY_ITEMS = 8
_STRING_BOUNDS = ("maxLength", "enum", "const", "pattern", "format")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def bound_schema(schema: dict) -> dict:
    """A copy of a JSON schema in which every string and array has a maximum length."""
    schema = copy.deepcopy(schema)
    _bound(schema)
    return schema


def _bound(node: object) -> None:
    if not isinstance(node, dict):
        return
    types = node.get("type")
    types = types if isinstance(types, list) else [types]
    if "string" in types and not any(k in node for k in _STRING_BOUNDS):
        node["maxLength"] = MAX_STRING_LENGTH
    if "array" in types and "maxItems" not in node:
        node["maxItems"] = max(MAX_ARRAY_ITEMS, node.get("minItems", 0))
    for key in _SUBSCHEMA_LISTS:
        for child in node.get(key) or []:
            _bound(child)
    for key in _SUBSCHEMA_MAPS:
        for child in (node.get(key) or {}).values():
            _bound(child)
    for key in ("items", "additionalProperties", "not"):
        _bound(node.get(key))


@dataclass
class ToolPlan:
    mode: str  # "none", "auto", "required" or "named"
    name: str | None = None  # the named function
    structured_outputs: StructuredOutputsParams | None = None
    tools: list[dict] | None = None  # what the chat template shows the model

    def parse(self, answer: str | None, tool_parser: ToolParser | None,
              partial: bool = False) -> tuple[str | None, list[FunctionCall]]:
        """(content, calls) of the answer (the output after any reasoning)."""
        if self.mode == "named":
            return None, [FunctionCall(name=self.name, arguments=answer or "")]
        if self.mode == "required":
            return _parse_required(answer or "", partial)
        if self.mode == "auto" and tool_parser is not None:
            return tool_parser.extract_tool_calls(answer or "", partial, self.tools)
        return answer, []


def _parse_required(answer: str, partial: bool) -> tuple[str | None, list[FunctionCall]]:
    """The calls of the array the grammar made; while it grows, those already closed."""
    try:
        calls = [json.loads(item) for item in _closed_items(answer)] if partial else json.loads(answer)
        return None, [FunctionCall(name=c["name"], arguments=json.dumps(c["parameters"])) for c in calls]
    except (ValueError, TypeError, KeyError):  # cut short (max_tokens): returned as text
        return answer or None, []


def _closed_items(text: str) -> list[str]:
    """The objects already closed at the top level of a partial JSON array."""
    items, depth, start, in_string, escaped = [], 0, 0, False, False
    for i, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            start = i if depth == 2 else start
        elif char in "]}":
            if depth == 2:
                items.append(text[start:i + 1])
            depth -= 1
    return items


def plan_tools(req: ChatCompletionRequest, tool_parser: ToolParser | None) -> ToolPlan:
    """ValueError naming the problem if the request's tool settings cannot be served."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if choice == "none":
        return ToolPlan("none", tools=tools or None)
    if choice == "auto":
        if tool_parser is None:
            raise ValueError('tools with tool_choice "auto" (the default) need the server started with '
                             '--tool-call-parser')
        return ToolPlan("auto", tools=tools)
    if req.response_format is not None or req.structured_outputs is not None:
        raise ValueError(f"tool_choice {_label(choice)} cannot be combined with response_format or structured_outputs")
    parameters = {t.function.name: bound_schema(t.function.parameters or {"type": "object", "properties": {}})
                  for t in req.tools}
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        return ToolPlan("named", name, StructuredOutputsParams(json=parameters[name]), tools)
    calls = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                        "required": ["name", "parameters"]} for name, schema in parameters.items()]}
    max_calls = 1 if req.parallel_tool_calls is False else MAX_CALLS
    schema = {"type": "array", "minItems": 1, "maxItems": max_calls, "items": calls}
    return ToolPlan("required", structured_outputs=StructuredOutputsParams(json=schema), tools=tools)


def _label(choice: object) -> str:
    return f"{{function: {choice.function.name}}}" if isinstance(choice, NamedToolChoice) else repr(choice)
