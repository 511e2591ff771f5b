"""A chat template that keeps earlier reasoning as GLM-4.5's does (written here, in its spirit): an assistant turn
after the last user message writes its `reasoning_content` in <think>...</think>, an earlier one an empty pair. Short
tags, so that a conversation fits the tiny checkpoint's context of 256 characters."""

GLM_STYLE_TEMPLATE = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}<|{{ m.role }}|>"
    "{% if m.role == 'assistant' %}"
    "{% if loop.index0 > ns.last_user and m.reasoning_content is string %}<think>{{ m.reasoning_content.strip() }}"
    "</think>{% else %}<think></think>{% endif %}"
    "{% endif %}{{ m.content or '' }}"
    "{% for call in m.tool_calls or [] %}<call>{{ call.function.name }}</call>{% endfor %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
# The reasoning of the turn before the last user message is dropped by the template; the tool-calling turn's is kept.
CONVERSATION = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
    {"role": "user", "content": "go"},
    {"role": "assistant", "content": None, "reasoning_content": "r2", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "ok"},
]


def renamed(messages: list[dict], key: str) -> list[dict]:
    """`messages` with their reasoning_content sent under `key` instead."""
    return [{(key if k == "reasoning_content" else k): v for k, v in m.items()} for m in messages]
