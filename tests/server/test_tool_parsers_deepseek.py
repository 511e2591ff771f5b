"""The deepseek_v31 and deepseek_v32 tool parsers on hand-written outputs in each model's exact format (as V3.1's
chat template and V3.2's DSML encoding write an assistant's calls): whole, partial, and streamed through ChatOutput
in every split, where the deltas must add up to the whole message. The deepseek_v32 parser also reads back the calls
latentserve's own V3.2 chat encoding writes into an assistant turn."""
import json
from dataclasses import replace

import pytest

from latentserve.engine.chat_template import render_chat
from latentserve.engine.deepseek_v32_chat import EOS, DeepSeekV32Encoding
from latentserve.engine.reasoning import get_reasoning_parser
from latentserve.server.chat_output import ChatOutput
from latentserve.server.tool_parsers import get_tool_parser
from latentserve.server.tools import ToolPlan
from tests.server.test_tool_parsers_glm_kimi import (TOKENIZER, TOOLS, WEATHER, calls_closed_one_by_one,
                                                   streamed_parts)


def v31_calls(*calls: tuple[str, dict]) -> str:
    body = "".join(f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{json.dumps(arguments)}<｜tool▁call▁end｜>"
                   for name, arguments in calls)
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def dsml_calls(*calls: tuple[str, dict]) -> str:
    """As V3.2's encoding writes calls: a string value as text (string="true"), any other as JSON."""
    def parameter(key, value):
        text, is_string = (value, "true") if isinstance(value, str) else (json.dumps(value), "false")
        return f'<｜DSML｜parameter name="{key}" string="{is_string}">{text}</｜DSML｜parameter>\n'
    body = "".join(f'<｜DSML｜invoke name="{name}">\n' + "".join(parameter(k, v) for k, v in arguments.items())
                   + "</｜DSML｜invoke>\n" for name, arguments in calls)
    return f"<｜DSML｜function_calls>\n{body}</｜DSML｜function_calls>"


CALLS = (("get_weather", WEATHER), ("get_time", {}))
OUTPUTS = {"deepseek_v31": "Let me check." + v31_calls(*CALLS),
           "deepseek_v32": "Let me check.\n\n" + dsml_calls(*CALLS)}


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_calls_and_plain_text(name):
    parser = get_tool_parser(name)()
    content, calls = parser.extract_tool_calls(OUTPUTS[name], tools=TOOLS)
    assert content.strip() == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", WEATHER), ("get_time", {})]
    assert parser.extract_tool_calls("No calls here.") == ("No calls here.", [])


def test_dsml_values_follow_their_string_mark():
    text = dsml_calls(("f", {"s": "123", "n": 123, "b": False, "o": {"k": [1, "x"]}, "t": "not json"}))
    _, calls = get_tool_parser("deepseek_v32")().extract_tool_calls(text)
    assert json.loads(calls[0].arguments) == {"s": "123", "n": 123, "b": False, "o": {"k": [1, "x"]}, "t": "not json"}
    raw = '<｜DSML｜function_calls><｜DSML｜invoke name="f"><｜DSML｜parameter name="x" string="false">not json' \
          '</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜function_calls>'
    assert json.loads(get_tool_parser("deepseek_v32")().extract_tool_calls(raw)[1][0].arguments) == {"x": "not json"}


def test_v3_and_v31_formats_are_not_each_other():
    """V3's parser finds no call in V3.1's format (its fence is missing), and V3.1's none in DSML."""
    assert get_tool_parser("deepseek_v3")().extract_tool_calls(OUTPUTS["deepseek_v31"])[1] == []
    assert get_tool_parser("deepseek_v31")().extract_tool_calls(OUTPUTS["deepseek_v32"])[1] == []


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_partial_output_holds_back_markers_and_closes_calls_one_by_one(name):
    assert calls_closed_one_by_one(name, OUTPUTS[name]) == 2


@pytest.mark.parametrize("name", sorted(OUTPUTS))
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_deltas_add_up_to_the_whole_message(name, step):
    text = "<think>Weather wanted.</think>" + OUTPUTS[name]

    def output() -> ChatOutput:
        return ChatOutput(get_reasoning_parser("deepseek_v3")(TOKENIZER), ToolPlan("auto", tools=TOOLS),
                          get_tool_parser(name)())
    message, reason = output().message(text, "stop")
    assert message.reasoning_content == "Weather wanted." and message.content.strip() == "Let me check."
    assert [c.function.name for c in message.tool_calls] == ["get_weather", "get_time"] and reason == "tool_calls"
    got = streamed_parts(output(), text, step)
    assert (got["reasoning"], got["content"]) == (message.reasoning_content, message.content)
    assert got["calls"] == [(c.function.name, c.function.arguments) for c in message.tool_calls]


# Values of every JSON kind, and strings that look like JSON, hold markup or span lines.
ROUND_TRIP = [("get_weather", {**WEATHER, "exact": True, "note": None, "ratio": 0.5, "list": [1, "x", {"k": []}]}),
              ("get_time", {}),
              ("quote", {"text": 'He said "hi",\nthen <b>left</b>.', "number_as_text": "123", "json_as_text": "[1]",
                         "unicode": "Zürich 東京"})]


@pytest.mark.parametrize("thinking", [False, True])
def test_dsv32_encoding_round_trips_through_the_parser(thinking):
    """An assistant turn with calls, rendered by the encoding: the text after the prompt that opens it (the model's
    output, less the end token) parses back to the same calls, with its reasoning and text apart."""
    tokenizer = replace(TOKENIZER, chat_encoding=DeepSeekV32Encoding(), tokenizer_mode="deepseek_v32")
    ask = {"role": "user", "content": "Weather, time and a quote?"}
    calls = [{"id": f"call-{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
             for i, (name, arguments) in enumerate(ROUND_TRIP)]
    reply = {"role": "assistant", "content": "Let me check.", "reasoning_content": "Three calls.", "tool_calls": calls}
    kwargs = {"thinking": thinking}
    prompt = render_chat(tokenizer, [ask], chat_template_kwargs=kwargs)
    whole = render_chat(tokenizer, [ask, reply], add_generation_prompt=False, chat_template_kwargs=kwargs)
    assert whole.startswith(prompt) and whole.endswith(EOS)
    output = whole[len(prompt):-len(EOS)]
    message, reason = ChatOutput(get_reasoning_parser("deepseek_v3")(TOKENIZER) if thinking else None,
                                 ToolPlan("auto", tools=TOOLS), get_tool_parser("deepseek_v32")()).message(output,
                                                                                                          "stop")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == ROUND_TRIP
    assert message.content.strip() == "Let me check." and reason == "tool_calls"
    assert message.reasoning_content == ("Three calls." if thinking else None)
