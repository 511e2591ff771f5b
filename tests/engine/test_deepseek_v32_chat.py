"""DeepSeek-V3.2's chat encoding (tokenizer mode deepseek_v32) through `render_chat`: each case's prompt written out
in full as the format says it reads, and each thing the format cannot say refused by name."""
from dataclasses import replace

import pytest

from latentserve.assets import DEFAULT_MODEL_DIR
from latentserve.engine.chat_renderer import TemplateKwargsError
from latentserve.engine.chat_template import chat_variables, render_chat
from latentserve.engine.deepseek_v32_chat import DeepSeekV32Encoding
from latentserve.engine.detokenizer import load_tokenizer

TOKENIZER = replace(load_tokenizer(DEFAULT_MODEL_DIR), chat_encoding=DeepSeekV32Encoding(),
                    tokenizer_mode="deepseek_v32")
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
SYSTEM = {"role": "system", "content": "Be brief."}
ASK = {"role": "user", "content": "Who begat Enos?"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time"}}]
# The system part's tools section for TOOLS, as the format writes it.
TOOLS_SECTION = (
    "## Tools\n"
    "You have access to a set of tools you can use to answer the user's question.\n"
    "You can invoke functions by writing a \"<｜DSML｜function_calls>\" block like the following as part of your "
    "reply to the user:\n"
    "<｜DSML｜function_calls>\n"
    "<｜DSML｜invoke name=\"$FUNCTION_NAME\">\n"
    "<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\n"
    "...\n"
    "</｜DSML｜invoke>\n"
    "<｜DSML｜invoke name=\"$FUNCTION_NAME2\">\n"
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜function_calls>\n"
    "String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects "
    "should use JSON format. The \"string\" attribute should be set to \"true\" for string type parameters and "
    "\"false\" for other types (numbers, booleans, arrays, objects).\n"
    "If the thinking_mode is enabled, then after function results you should strongly consider outputting a "
    "thinking block. Here is an example:\n"
    "<｜DSML｜function_calls>\n"
    "...\n"
    "</｜DSML｜function_calls>\n"
    "<function_results>\n"
    "...\n"
    "</function_results>\n"
    "<think>...thinking about results</think>\n"
    "Here are the functions available in JSONSchema format:\n"
    "<functions>\n"
    '{"name": "get_weather", "description": "Weather of a city", "parameters": {"type": "object", "properties": '
    '{"city": {"type": "string"}}}}\n'
    '{"name": "get_time"}\n'
    "</functions>\n"
)
CALLED = {"role": "assistant", "content": "", "reasoning_content": "Both are needed.", "tool_calls": [
    {"id": "call-1", "type": "function", "function": {"name": "get_weather",
                                                      "arguments": '{"city": "Paris", "days": 2, "units": ["C"]}'}},
    {"id": "call-2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}
RESULTS = [{"role": "tool", "tool_call_id": "call-1", "content": "sunny"},
           {"role": "tool", "tool_call_id": "call-2", "content": "noon"}]
# CALLED's calls in DSML, as its assistant turn writes them.
CALLED_DSML = ("<｜DSML｜function_calls>\n"
               "<｜DSML｜invoke name=\"get_weather\">\n"
               "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
               "<｜DSML｜parameter name=\"days\" string=\"false\">2</｜DSML｜parameter>\n"
               "<｜DSML｜parameter name=\"units\" string=\"false\">[\"C\"]</｜DSML｜parameter>\n"
               "</｜DSML｜invoke>\n"
               "<｜DSML｜invoke name=\"get_time\">\n"
               "\n"
               "</｜DSML｜invoke>\n"
               "</｜DSML｜function_calls>")


def render(messages, tools=None, **options) -> str:
    return render_chat(TOKENIZER, messages, tools, **options)


def test_system_and_user_thinking_off_by_default():
    assert render([SYSTEM, ASK]) == f"{BOS}Be brief.<｜User｜>Who begat Enos?<｜Assistant｜></think>"
    assert render([ASK], chat_template_kwargs={"thinking": False}) == \
        f"{BOS}<｜User｜>Who begat Enos?<｜Assistant｜></think>"


@pytest.mark.parametrize("switch", ["thinking", "enable_thinking"])
def test_thinking_opens_the_reply_in_its_reasoning(switch):
    assert render([SYSTEM, ASK], chat_template_kwargs={switch: True}) == \
        f"{BOS}Be brief.<｜User｜>Who begat Enos?<｜Assistant｜><think>"
    assert chat_variables(TOKENIZER) == {"thinking", "enable_thinking"}


def test_without_generation_prompt_the_prompt_ends_with_the_last_message():
    assert render([SYSTEM, ASK], add_generation_prompt=False) == f"{BOS}Be brief.<｜User｜>Who begat Enos?"
    answered = [ASK, {"role": "assistant", "content": "Seth."}]
    assert render(answered, add_generation_prompt=False) == \
        f"{BOS}<｜User｜>Who begat Enos?<｜Assistant｜></think>Seth.{EOS}"


@pytest.mark.parametrize("thinking", [True, False])
def test_earlier_turns_lose_their_reasoning(thinking):
    messages = [SYSTEM, ASK, {"role": "assistant", "content": "Seth.", "reasoning_content": "Genesis 4:26."},
                {"role": "user", "content": "And Seth?"}]
    assert render(messages, chat_template_kwargs={"thinking": thinking}) == (
        f"{BOS}Be brief.<｜User｜>Who begat Enos?<｜Assistant｜></think>Seth.{EOS}"
        f"<｜User｜>And Seth?<｜Assistant｜>{'<think>' if thinking else '</think>'}")


def test_tools_calls_and_results_keep_the_current_reasoning():
    """Thinking on: the turn after the last user message keeps its reasoning; the results reopen the reasoning."""
    prompt = render([SYSTEM, {"role": "user", "content": "Weather and time?"}, CALLED, *RESULTS], TOOLS,
                    chat_template_kwargs={"thinking": True})
    assert prompt == (f"{BOS}Be brief.\n\n{TOOLS_SECTION}<｜User｜>Weather and time?<｜Assistant｜><think>"
                      f"Both are needed.</think>\n\n{CALLED_DSML}{EOS}"
                      "\n\n<function_results>\n<result>sunny</result>\n<result>noon</result>\n</function_results>"
                      "\n\n<think>")


def test_tools_without_a_system_message_and_thinking_off():
    prompt = render([{"role": "user", "content": "Weather and time?"}, CALLED, *RESULTS,
                     {"role": "assistant", "content": "Sunny at noon."}, {"role": "user", "content": "Thanks."}],
                    TOOLS)
    assert prompt == (f"{BOS}\n\n{TOOLS_SECTION}<｜User｜>Weather and time?<｜Assistant｜></think>"
                      f"\n\n{CALLED_DSML}{EOS}"
                      "\n\n<function_results>\n<result>sunny</result>\n<result>noon</result>\n</function_results>"
                      f"\n\n</think>Sunny at noon.{EOS}<｜User｜>Thanks.<｜Assistant｜></think>")


def test_developer_message_is_a_user_turn_of_its_own_form():
    assert render([{"role": "developer", "content": "Answer in French."}]) == \
        f"{BOS}<｜User｜>\n\n# The user's message is: Answer in French.<｜Assistant｜></think>"


@pytest.mark.parametrize("thinking, last, expected", [
    (False, {"content": "And Seth "}, "</think>And Seth "),
    (True, {"content": "", "reasoning_content": "Genesis says"}, "<think>Genesis says"),
    (True, {"content": "Seth", "reasoning_content": "Genesis 4."}, "<think>Genesis 4.</think>Seth"),
])
def test_continue_final_message(thinking, last, expected):
    prompt = render([ASK, {"role": "assistant", **last}], add_generation_prompt=False, continue_final_message=True,
                    chat_template_kwargs={"thinking": thinking})
    assert prompt == f"{BOS}<｜User｜>Who begat Enos?<｜Assistant｜>{expected}"


@pytest.mark.parametrize("kwargs, message", [
    ({"reasoning_effort": "high"}, r"the DeepSeek-V3.2 chat encoding \(tokenizer mode deepseek_v32\) reads no "
                                   r"variable 'reasoning_effort' \(the variables it reads: enable_thinking, thinking\)"),
    ({"tools": []}, "'tools' is set by tools, not by chat_template_kwargs"),
    ({"thinking": "yes"}, "'thinking' must be true or false, got 'yes'"),
    ({"thinking": True, "enable_thinking": False}, "one switch here, and they disagree"),
])
def test_bad_kwargs_are_refused_by_name(kwargs, message):
    with pytest.raises(TemplateKwargsError, match=message):
        render([ASK], chat_template_kwargs=kwargs)


@pytest.mark.parametrize("messages, options, message", [
    ([ASK, {"role": "assistant", "content": "Seth."}], {}, "add_generation_prompt: in the DeepSeek-V3.2 chat format"),
    ([SYSTEM], {}, "add_generation_prompt: in the DeepSeek-V3.2 chat format"),
    ([ASK, CALLED, RESULTS[0]], {}, "message 1: the assistant called 2 tools, but only 1 results follow"),
    ([ASK, CALLED, RESULTS[0], ASK], {}, "message 1: the assistant called 2 tools, but only 1 results follow"),
    ([ASK, CALLED, *RESULTS, RESULTS[0]], {}, "message 4: a tool result with no call of the assistant's left"),
    ([ASK, RESULTS[0]], {}, "message 1: a tool result with no call"),
    ([ASK, CALLED, RESULTS[1], RESULTS[0]], {}, "message 2: the result of call 'call-2' stands where the format "
                                                 "expects the result of call 'call-1'"),
    ([{**ASK, "name": "Adam"}], {}, "message 0: the DeepSeek-V3.2 chat format has no place for a user message's "
                                    "'name'"),
    ([{"role": "critic", "content": "x"}], {}, "message 0: role 'critic' is not one of"),
    ([{"role": "developer", "content": ""}], {}, "message 0: a developer message needs content"),
    ([ASK, {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}],
     {"add_generation_prompt": False}, "message 1: tool call 0's arguments must be a JSON object"),
    ([ASK, {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}],
     {"add_generation_prompt": False}, "message 1: tool call 0's arguments are not JSON"),
    ([ASK, CALLED], {"add_generation_prompt": False, "continue_final_message": True},
     "continue_final_message: the last message has tool calls"),
    ([ASK, {"role": "assistant", "content": "", "reasoning_content": "Hm."}],
     {"add_generation_prompt": False, "continue_final_message": True}, "the last message has no text to continue"),
    ([ASK], {"add_generation_prompt": False, "continue_final_message": True},
     "the last message must be the assistant's"),
])
def test_what_the_format_cannot_say_is_refused(messages, options, message):
    with pytest.raises(ValueError, match=message):
        render(messages, **options)
