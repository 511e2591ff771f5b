"""The glm45 and kimi_k2 tool parsers and reasoning parsers on hand-written outputs in each model's exact format
(as its chat template writes an assistant's calls): whole, and streamed through ChatOutput in every split, where the
streamed deltas must add up to the whole message."""
import json

import pytest

from latentserve.assets import DEFAULT_MODEL_DIR
from latentserve.engine.detokenizer import load_tokenizer
from latentserve.engine.reasoning import get_reasoning_parser
from latentserve.server.chat_output import ChatOutput
from latentserve.server.tool_parsers import get_tool_parser
from latentserve.server.tools import ToolPlan

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "zip": {"type": ["string", "null"]}, "days": {"type": "integer"},
    "units": {"type": "object"}}}}}]


def glm_call(name: str, arguments: dict, newlines: bool = True) -> str:
    """As GLM's template writes a call: a string raw, anything else as JSON (4.7 and later without the newlines)."""
    nl = "\n" if newlines else ""
    pairs = "".join(f"{nl}<arg_key>{k}</arg_key>{nl}<arg_value>{v if isinstance(v, str) else json.dumps(v)}</arg_value>"
                    for k, v in arguments.items())
    return f"<tool_call>{name}{pairs}{nl}</tool_call>"


def kimi_calls(*calls: tuple[str, str]) -> str:
    body = "".join(f"<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>{arguments}<|tool_call_end|>"
                   for i, (name, arguments) in enumerate(calls))
    return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"


WEATHER = {"city": "Paris", "zip": "75001", "days": 3, "units": {"t": "c"}}
GLM_OUTPUT = "Let me check.\n" + glm_call("get_weather", WEATHER) + "\n" + glm_call("get_time", {})
KIMI_OUTPUT = "Let me check." + kimi_calls(("get_weather", '{"city": "Paris"}'), ("get_time", "{}"))


@pytest.mark.parametrize("newlines", [True, False])
def test_glm45_calls_are_typed_by_the_request_schema(newlines):
    text = "Let me check.\n" + glm_call("get_weather", WEATHER, newlines) + glm_call("get_time", {}, newlines)
    content, calls = get_tool_parser("glm45")().extract_tool_calls(text, tools=TOOLS)
    assert content == "Let me check.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", WEATHER), ("get_time", {})]


def test_glm45_without_a_schema_decodes_json_and_keeps_the_rest_raw():
    text = glm_call("f", {"n": 7, "s": "not json", "b": True})
    _, calls = get_tool_parser("glm45")().extract_tool_calls(text)
    assert json.loads(calls[0].arguments) == {"n": 7, "s": "not json", "b": True}
    _, typed = get_tool_parser("glm45")().extract_tool_calls(glm_call("get_weather", {"city": "123"}), tools=TOOLS)
    assert json.loads(typed[0].arguments) == {"city": "123"}  # a string parameter stays a string


def test_kimi_k2_calls_and_plain_text():
    parser = get_tool_parser("kimi_k2")()
    content, calls = parser.extract_tool_calls(KIMI_OUTPUT)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert parser.extract_tool_calls("No calls here.") == ("No calls here.", [])
    assert get_tool_parser("glm45")().extract_tool_calls("No calls here.") == ("No calls here.", [])


def calls_closed_one_by_one(name: str, text: str) -> int:
    """The calls `name`'s parser finds in `text` cut at every character: content only grows and never shows a
    marker's start, calls only add up; their number at the end."""
    parser, seen_calls, previous_content = get_tool_parser(name)(), 0, ""
    for cut in range(1, len(text) + 1):
        content, calls = parser.extract_tool_calls(text[:cut], partial=cut < len(text), tools=TOOLS)
        assert (content or "").startswith(previous_content) and "<" not in (content or "")
        assert len(calls) >= seen_calls
        previous_content, seen_calls = content or "", len(calls)
    return seen_calls


@pytest.mark.parametrize("name, text", [("glm45", GLM_OUTPUT), ("kimi_k2", KIMI_OUTPUT)])
def test_partial_output_holds_back_markers_and_closes_calls_one_by_one(name, text):
    assert calls_closed_one_by_one(name, text) == 2


TOKENIZER = load_tokenizer(DEFAULT_MODEL_DIR)  # has <think> and </think>, as GLM's and Kimi's do

# (reasoning parser, tool parser, output, reasoning, content, call names)
STREAMS = [
    ("glm45", "glm45", "<think>Weather wanted.</think>\n" + GLM_OUTPUT, "Weather wanted.", "\nLet me check.\n",
     ["get_weather", "get_time"]),
    ("glm45", "glm45", "<think></think>Just text.", None, "Just text.", []),  # thinking off in the template
    ("kimi_k2", "kimi_k2", "<think>Weather wanted.</think>" + KIMI_OUTPUT, "Weather wanted.", "Let me check.",
     ["get_weather", "get_time"]),
    # K2 Thinking may open its calls section without closing its reasoning: the section ends the reasoning
    ("kimi_k2", "kimi_k2", "Weather wanted, <|tool_c is no marker." + kimi_calls(("get_time", "{}")),
     "Weather wanted, <|tool_c is no marker.", None, ["get_time"]),
    ("kimi_k2", "kimi_k2", "<think>Still thinking", "Still thinking", None, []),
]


def streamed_parts(streaming: ChatOutput, text: str, step: int) -> dict:
    """The reasoning, content and calls `streaming`'s deltas add up to when `text` arrives `step` characters at a
    time."""
    previous, got = "", {"reasoning": "", "content": "", "calls": []}
    for cut in list(range(step, len(text), step)) + [len(text)]:
        delta = streaming.delta(previous, text[:cut], finished=cut == len(text))
        previous = text[:cut]
        if delta is None:
            continue
        got["reasoning"] += delta.reasoning_content or ""
        got["content"] += delta.content or ""
        got["calls"] += [(c.function.name, c.function.arguments) for c in delta.tool_calls or []]
    return got


@pytest.mark.parametrize("reasoning_name, tool_name, text, reasoning, content, names", STREAMS)
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_deltas_add_up_to_the_whole_message(reasoning_name, tool_name, text, reasoning, content, names, step):
    def output() -> ChatOutput:
        return ChatOutput(get_reasoning_parser(reasoning_name)(TOKENIZER), ToolPlan("auto", tools=TOOLS),
                          get_tool_parser(tool_name)())
    message, reason = output().message(text, "stop")
    assert (message.reasoning_content, message.content) == (reasoning, content)
    assert [c.function.name for c in message.tool_calls] == names
    assert reason == ("tool_calls" if names else "stop")
    got = streamed_parts(output(), text, step)
    assert (got["reasoning"] or None, got["content"] or None) == (reasoning, content)
    assert got["calls"] == [(c.function.name, c.function.arguments) for c in message.tool_calls]


def test_kimi_k2_reasoning_ends_at_think_before_a_section():
    parser = get_reasoning_parser("kimi_k2")(TOKENIZER)
    assert parser.end_token_id == TOKENIZER.tokenizer.token_to_id("</think>")
    calls = kimi_calls(("f", "{}"))
    assert parser.extract_reasoning("<think>a</think>b" + calls) == ("a", "b" + calls)
