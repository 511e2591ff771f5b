"""DeepSeek-V3.2's chat format (`--tokenizer-mode deepseek_v32`): its checkpoints ship it as Python, not as a Jinja
chat template, so latentserve writes it itself. A conversation reads:

    <｜begin▁of▁sentence｜>SYSTEM[\\n\\nTOOLS SECTION]
    <｜User｜>USER<｜Assistant｜>T                              T: <think> with thinking on, else </think>
    [REASONING</think>]ANSWER[\\n\\nDSML CALLS]<｜end▁of▁sentence｜>
    \\n\\n<function_results>\\n<result>RESULT</result>...\\n</function_results>\\n\\nT

(no newlines between the parts but those shown). A user turn opens the assistant's reply, so does a complete set of
tool results; the reply itself has no opening tag. An assistant turn's reasoning is written only with thinking on
and only after the last user message: the format drops the reasoning of earlier turns. A `developer` message is a
user turn of DeepSeek's own developer form. Tool results are matched to the calls by order.
"""
from __future__ import annotations

import json
from typing import Any

from latentserve.engine.chat_renderer import TemplateKwargsError

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
DEVELOPER_LEAD = "\n\n# The user's message is: "
THINKING_SWITCHES = ("thinking", "enable_thinking")  # either turns thinking on (vLLM reads both)

# The model was trained on this text: it must stay byte for byte as it is.
TOOLS_SECTION = """## Tools
You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "<｜DSML｜function_calls>" block like the following as part of your reply to the user:
<｜DSML｜function_calls>
<｜DSML｜invoke name="$FUNCTION_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$FUNCTION_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜function_calls>
String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" for other types (numbers, booleans, arrays, objects).
If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking block. Here is an example:
<｜DSML｜function_calls>
...
</｜DSML｜function_calls>
<function_results>
...
</function_results>
<think>...thinking about results</think>
Here are the functions available in JSONSchema format:
<functions>
{schemas}
</functions>
"""

# The keys each role's message may carry; any other is refused rather than left out of the prompt unseen. A tool
# result's `name` repeats its call's, which the format already wrote.
_KEYS = {"system": {"content"}, "developer": {"content"}, "user": {"content"},
         "assistant": {"content", "tool_calls", "reasoning_content", "reasoning"},
         "tool": {"content", "tool_call_id", "name"}}


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def tools_section(tools: list[dict]) -> str:
    """The system part's tools section: each function's definition as one line of JSON."""
    functions = []
    for tool in tools:
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or \
                not isinstance(tool.get("function"), dict):
            raise ValueError("tools: each tool must be {'type': 'function', 'function': {...}}")
        functions.append(_json(tool["function"]))
    return TOOLS_SECTION.format(schemas="\n".join(functions))


def dsml_calls(calls: list[tuple[str, dict[str, Any]]]) -> str:
    """Calls (name, arguments) in DSML: a string argument as its text (string="true"), any other as JSON."""
    def parameter(key: str, value: Any) -> str:
        text, is_string = (value, "true") if isinstance(value, str) else (_json(value), "false")
        return f'<｜DSML｜parameter name="{key}" string="{is_string}">{text}</｜DSML｜parameter>'
    invokes = [f'<｜DSML｜invoke name="{name}">\n' + "\n".join(parameter(k, v) for k, v in arguments.items())
               + "\n</｜DSML｜invoke>" for name, arguments in calls]
    return "<｜DSML｜function_calls>\n" + "\n".join(invokes) + "\n</｜DSML｜function_calls>"


def _calls(index: int, message: dict) -> list[tuple[str, dict[str, Any]]]:
    """An assistant message's tool_calls (OpenAI's shape, arguments as JSON text or an object) as (name, arguments)."""
    calls = []
    for n, call in enumerate(message.get("tool_calls") or []):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"message {index}: tool call {n} must be {{'type': 'function', 'function': "
                             "{'name': ..., 'arguments': ...}}")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                raise ValueError(f"message {index}: tool call {n}'s arguments are not JSON ({e.msg})") from None
        if not isinstance(arguments, dict):
            raise ValueError(f"message {index}: tool call {n}'s arguments must be a JSON object: DSML writes each "
                             "argument by its name")
        calls.append((function["name"], arguments))
    return calls


def _check_message(index: int, message: Any) -> None:
    role = message.get("role") if isinstance(message, dict) else None
    if role not in _KEYS:
        raise ValueError(f"message {index}: role {role!r} is not one of {', '.join(sorted(_KEYS))}")
    for key, value in message.items():
        if key != "role" and value is not None and key not in _KEYS[role]:
            raise ValueError(f"message {index}: the DeepSeek-V3.2 chat format has no place for a {role} message's "
                             f"{key!r}")
    if not isinstance(message.get("content") or "", str):
        raise ValueError(f"message {index}: content must be text")
    reasoning, other = message.get("reasoning_content"), message.get("reasoning")
    if reasoning is not None and other is not None and reasoning != other:
        raise ValueError(f"message {index}: reasoning_content and reasoning differ (they name the same text)")


class _Conversation:
    """One conversation being written, message by message."""

    def __init__(self, messages: list[dict], thinking: bool) -> None:
        self.messages, self.thinking = messages, thinking
        # Turns after this one are the current exchange: theirs is the only reasoning kept.
        self.last_user = max((i for i, m in enumerate(messages) if m["role"] in ("user", "developer")), default=-1)
        # The last assistant message, its calls' ids, and how many of them have their result so far.
        self.caller, self.answered = -1, 0
        self.call_ids: list[str | None] = []

    def think(self, index: int) -> str:
        """How the reply opened after message `index` begins: in its reasoning, or past it."""
        return THINK if self.thinking and index >= self.last_user else END_THINK

    def check_results(self) -> None:
        """Before a message other than a result, and at the end: the last calls have all their results, or none."""
        if 0 < self.answered < len(self.call_ids):
            raise ValueError(f"message {self.caller}: the assistant called {len(self.call_ids)} tools, but only "
                             f"{self.answered} results follow (the format closes the results once all are in)")

    def assistant(self, index: int, message: dict, end: bool) -> str:
        """An assistant turn: closed by EOS where `end`, else left open after its last text, to be continued."""
        content, calls = message.get("content") or "", _calls(index, message)
        reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
        kept = self.thinking and index > self.last_user
        self.caller, self.answered = index, 0
        self.call_ids = [call.get("id") for call in message.get("tool_calls") or []]
        if not end:
            if calls:
                raise ValueError("continue_final_message: the last message has tool calls, which the format writes "
                                 "after its text: that text cannot be continued")
            if not content and not (kept and reasoning):
                raise ValueError("continue_final_message: the last message has no text to continue")
            if not content:  # only reasoning so far: the reply goes on thinking
                return reasoning
        text = (reasoning + END_THINK if kept else "") + content
        if calls:
            text += "\n\n" + dsml_calls(calls)
        return text + EOS if end else text

    def result(self, index: int, message: dict) -> str:
        """A tool result, opening the results block at the first of the calls' and closing it at the last."""
        if self.answered >= len(self.call_ids):
            raise ValueError(f"message {index}: a tool result with no call of the assistant's left to answer")
        given, expected = message.get("tool_call_id"), self.call_ids[self.answered]
        if given is not None and expected is not None and given != expected:
            raise ValueError(f"message {index}: the result of call {given!r} stands where the format expects the "
                             f"result of call {expected!r}: results follow the calls in order")
        text = "\n\n<function_results>" if self.answered == 0 else ""
        text += f"\n<result>{message.get('content') or ''}</result>"
        self.answered += 1
        return text + ("\n</function_results>" if self.answered == len(self.call_ids) else "")

    def write(self, tools: list[dict] | None, add_generation_prompt: bool, continue_final_message: bool) -> str:
        parts, last = [BOS], len(self.messages) - 1
        tools_text = "\n\n" + tools_section(tools) if tools else ""
        if tools_text and (not self.messages or self.messages[0]["role"] != "system"):
            parts.append(tools_text)  # a system part of the tools alone
        opening = ""  # what opens the assistant's reply after the message last written
        for i, message in enumerate(self.messages):
            role, content = message["role"], message.get("content") or ""
            if role != "tool":
                self.check_results()
            if role in ("user", "developer"):
                if role == "developer" and not content:
                    raise ValueError(f"message {i}: a developer message needs content")
                parts.append(USER + (DEVELOPER_LEAD if role == "developer" else "") + content)
                opening = ASSISTANT + self.think(i)
            elif role == "system":
                parts.append(content + (tools_text if i == 0 else ""))
                opening = ""
            elif role == "assistant":
                parts.append(self.assistant(i, message, end=not (continue_final_message and i == last)))
                opening = ""
            else:
                parts.append(self.result(i, message))
                opening = "\n\n" + self.think(i) if self.answered == len(self.call_ids) else ""
            if i < last:
                parts.append(opening)
        self.check_results()
        if continue_final_message and (not self.messages or self.messages[-1]["role"] != "assistant"):
            raise ValueError("continue_final_message: the last message must be the assistant's, to continue")
        if add_generation_prompt:
            if not opening:
                raise ValueError("add_generation_prompt: in the DeepSeek-V3.2 chat format the assistant's reply "
                                 "opens after a user or developer message or after all of a call's tool results; "
                                 "this conversation ends otherwise (continue an assistant message with "
                                 "continue_final_message, or pass add_generation_prompt false)")
            parts.append(opening)
        return "".join(parts)


def thinking_switch(kwargs: dict[str, Any]) -> bool:
    """Whether thinking is on: `thinking` or `enable_thinking` (one switch under two names), off by default."""
    given = {name: kwargs[name] for name in THINKING_SWITCHES if name in kwargs}
    for name, value in given.items():
        if not isinstance(value, bool):
            raise TemplateKwargsError(f"chat_template_kwargs: {name!r} must be true or false, got {value!r}")
    if len(set(given.values())) > 1:
        raise TemplateKwargsError("chat_template_kwargs: 'thinking' and 'enable_thinking' are one switch here, and "
                                  "they disagree: give one, or both alike")
    return any(given.values())


class DeepSeekV32Encoding:
    """The renderer of `--tokenizer-mode deepseek_v32` (a ChatRenderer)."""

    description = "the DeepSeek-V3.2 chat encoding (tokenizer mode deepseek_v32)"

    def variables(self) -> frozenset[str]:
        return frozenset(THINKING_SWITCHES)

    def render(self, messages: list[dict], tools: list[dict] | None, *, add_generation_prompt: bool,
               continue_final_message: bool, kwargs: dict[str, Any]) -> str:
        for i, message in enumerate(messages):
            _check_message(i, message)
        conversation = _Conversation(messages, thinking_switch(kwargs))
        return conversation.write(tools, add_generation_prompt, continue_final_message)
