"""Anthropic's Messages API through the official anthropic client against live servers: answers equal the OpenAI chat
endpoint's for the same conversation, prompts equal transformers' rendering of it, errors in Anthropic's shape."""
from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from latentserve.assets import DEFAULT_MODEL_DIR
from tests.server.conftest import API_KEY, MODEL_NAME, LiveServer

GREEDY = {"temperature": 0}  # the newest client has no temperature argument: sent as an extra field
MESSAGES = [{"role": "user", "content": "Name a color!"}]
SYSTEM = "Be brief."
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
           "required": ["city"]}
TOOLS = [{"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                                  "parameters": WEATHER}}]
FORCED = {"type": "tool", "name": "get_weather"}
# The embedded model's template with DeepSeek-V3.1's switch: thinking off closes the reasoning in the prompt.
THINKING_TEMPLATE = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR).chat_template.replace(
    "{% if add_generation_prompt %}{{ '<|Assistant|>' }}{% endif %}",
    "{% if add_generation_prompt %}{{ '<|Assistant|>' }}{% if thinking is defined and not thinking %}"
    "{{ '</think>' }}{% endif %}{% endif %}")


def anthropic_client(server: LiveServer, **auth) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, max_retries=0, **(auth or {"api_key": API_KEY}))


def openai_client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def rendered_ids(model_dir, messages, **options) -> list[int]:
    """The conversation as transformers' chat templating tokenizes it: an independent reference."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              **options)["input_ids"])


def streamed(client: anthropic.Anthropic, **body) -> tuple[anthropic.types.Message, list[str]]:
    """The message the client's stream helper assembles, and the events' types in order."""
    with client.messages.stream(**body) as stream:
        types = [event.type for event in stream]
        return stream.get_final_message(), types


def same_message(streamed_message, whole) -> None:
    """The same answer; tool calls' ids are new in each."""
    keep = {"content": {"__all__": {"type", "text", "thinking", "signature", "name", "input"}}, "stop_reason": True,
            "stop_sequence": True, "usage": True, "model": True, "role": True}
    assert streamed_message.model_dump(include=keep) == whole.model_dump(include=keep)
    assert all(block.id.startswith("chatcmpl-tool-") for block in streamed_message.content if block.type == "tool_use")


@pytest.fixture
def client(server) -> anthropic.Anthropic:
    return anthropic_client(server)


def ask(client, **body):
    return client.messages.create(**{"model": MODEL_NAME, "max_tokens": 30, "messages": MESSAGES,
                                     "extra_body": GREEDY, **body})


def test_reply_equals_the_chat_endpoints(server, client, model_dir):
    for system in (None, SYSTEM, [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]):
        chat_messages = ([{"role": "system", "content": SYSTEM}] if system else []) + MESSAGES
        chat = openai_client(server).chat.completions.create(model=MODEL_NAME, messages=chat_messages, max_tokens=30,
                                                             temperature=0)
        message = ask(client, **({"system": system} if system else {}))
        assert [block.type for block in message.content] == ["text"]
        assert message.content[0].text == chat.choices[0].message.content
        assert message.usage.input_tokens == chat.usage.prompt_tokens == len(rendered_ids(model_dir, chat_messages))
        assert message.usage.output_tokens == chat.usage.completion_tokens
        assert message.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
        assert message.id.startswith("msg_") and message.model == MODEL_NAME and message.role == "assistant"
        counted = client.messages.count_tokens(model=MODEL_NAME, messages=MESSAGES, **({"system": system} if system
                                                                                       else {}))
        assert counted.input_tokens == message.usage.input_tokens


def test_stop_sequence_and_max_tokens(client):
    text = ask(client).content[0].text
    assert len(text) >= 12, "the greedy answer is too short to cut"
    sequence = text[8:11]
    message = ask(client, stop_sequences=["never there", sequence])
    assert message.content[0].text == text[:text.index(sequence)]
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", sequence)
    short = ask(client, max_tokens=3)
    assert (short.stop_reason, short.stop_sequence, short.usage.output_tokens) == ("max_tokens", None, 3)
    assert text.startswith(short.content[0].text)


def test_stream_reassembles_the_answer(client):
    for body in ({}, {"stop_sequences": [ask(client).content[0].text[8:11]]}, {"max_tokens": 3}):
        whole = ask(client, **body)
        message, types = streamed(client, model=MODEL_NAME, max_tokens=body.get("max_tokens", 30), messages=MESSAGES,
                                  extra_body=GREEDY, **{k: v for k, v in body.items() if k != "max_tokens"})
        same_message(message, whole)
        assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]


def test_raw_events_are_named_by_their_type(server):
    body = {"model": MODEL_NAME, "max_tokens": 5, "messages": MESSAGES, "stream": True, **GREEDY}
    response = httpx.post(f"{server.url}/v1/messages", json=body, headers={"x-api-key": API_KEY}, timeout=30)
    events = [block.split("\n") for block in response.text.strip().split("\n\n")]
    for name, data in events:
        assert json.loads(data.removeprefix("data: "))["type"] == name.removeprefix("event: ")
    assert [name for name, _ in events] == ["event: message_start", "event: content_block_start"] + [
        "event: content_block_delta"] * (len(events) - 5) + ["event: content_block_stop", "event: message_delta",
                                                             "event: message_stop"]


def test_api_key_as_x_api_key_or_bearer_on_messages_only(server):
    assert ask(anthropic_client(server, auth_token=API_KEY)).content  # Authorization: Bearer
    with pytest.raises(anthropic.AuthenticationError) as error:
        ask(anthropic_client(server, api_key="wrong"))
    assert error.value.body["error"]["type"] == "authentication_error"
    chat = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=chat, headers={"x-api-key": API_KEY})
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"  # OpenAI's shape


@pytest.mark.parametrize("body, kind, words", [
    ({"extra_body": {"frobnicate": 1}}, "invalid_request_error", ["frobnicate"]),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "url", "url": "http://example.com/a.png"}}]}]}, "invalid_request_error", ["'image'"]),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]}]},
     "invalid_request_error", ["'document'", "tool_result"]),
    ({"model": "claude-opus"}, "not_found_error", ["'claude-opus'", MODEL_NAME]),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 2048}, "invalid_request_error",
     ["thinking", "switch"]),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "invalid_request_error", ["budget_tokens"]),
    ({"tool_choice": {"type": "any"}}, "invalid_request_error", ["tool_choice", "needs tools"]),
    ({"extra_body": {"temperature": 1.5}}, "invalid_request_error", ["temperature"]),
])
def test_errors_in_anthropics_shape(server, client, body, kind, words):
    error_class = anthropic.NotFoundError if kind == "not_found_error" else anthropic.BadRequestError
    with pytest.raises(error_class) as error:
        ask(client, **body)
    assert error.value.body["type"] == "error" and error.value.body["error"]["type"] == kind
    assert all(word in error.value.body["error"]["message"] for word in words), error.value.body
    server.wait_idle()


def test_missing_max_tokens_is_named(client):
    with pytest.raises(anthropic.BadRequestError) as error:
        client.post("/v1/messages", body={"model": MODEL_NAME, "messages": MESSAGES}, cast_to=httpx.Response)
    assert error.value.body["error"] == {"type": "invalid_request_error", "message": "max_tokens: Field required"}


@pytest.fixture(scope="module")
def tools_server():
    server = LiveServer(DEFAULT_MODEL_DIR, tool_call_parser="deepseek_v3")
    yield server
    server.stop()


def test_forced_tool_use_equals_the_named_chat_call(tools_server):
    client = anthropic_client(tools_server)
    body = {"model": MODEL_NAME, "max_tokens": 60, "messages": MESSAGES, "tools": TOOLS, "extra_body": GREEDY}
    message = client.messages.create(tool_choice=FORCED, **body)
    chat = openai_client(tools_server).chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=60, temperature=0, tools=OPENAI_TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = chat.choices[0].message.tool_calls
    [block] = message.content
    assert (block.type, block.name, block.input) == ("tool_use", "get_weather", json.loads(call.function.arguments))
    jsonschema.validate(block.input, WEATHER)
    assert message.stop_reason == "tool_use" and message.usage.input_tokens == chat.usage.prompt_tokens
    same_message(streamed(client, tool_choice=FORCED, **body)[0], message)
    required = client.messages.create(tool_choice={"type": "any", "disable_parallel_tool_use": True}, **body)
    assert [b.type for b in required.content] == ["tool_use"] and required.stop_reason == "tool_use"
    jsonschema.validate(required.content[0].input, WEATHER)
    same_message(streamed(client, tool_choice={"type": "any", "disable_parallel_tool_use": True}, **body)[0],
                 required)


@pytest.mark.parametrize("is_error", [False, True])
def test_tool_result_renders_as_the_chat_paths_tool_message(tools_server, is_error):
    client = anthropic_client(tools_server)
    body = {"model": MODEL_NAME, "tools": TOOLS, "extra_body": GREEDY}
    first = client.messages.create(max_tokens=60, messages=MESSAGES, tool_choice=FORCED, **body)
    chat = openai_client(tools_server).chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=60, temperature=0, tools=OPENAI_TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0].message
    [block] = first.content
    result = {"type": "tool_result", "tool_use_id": block.id, "content": [{"type": "text", "text": "Sunny"}],
              "is_error": is_error}
    # The thinking becomes the turn's reasoning_content, which the embedded model's template does not read.
    messages = MESSAGES + [{"role": "assistant", "content": [{"type": "thinking", "thinking": "unread",
                                                              "signature": ""}, block]},
                           {"role": "user", "content": [result, {"type": "text", "text": "And tomorrow?"}]}]
    # The chat path's conversation: the model's own call, its result as a tool message, the user's text after it.
    reference = MESSAGES + [chat.model_dump(exclude_none=True), {
        "role": "tool", "tool_call_id": chat.tool_calls[0].id, "content": ("Error: " if is_error else "") + "Sunny"},
        {"role": "user", "content": "And tomorrow?"}]
    expected = rendered_ids(DEFAULT_MODEL_DIR, reference, tools=OPENAI_TOOLS)
    assert client.messages.count_tokens(model=MODEL_NAME, messages=messages, tools=TOOLS).input_tokens == len(expected)
    second = client.messages.create(max_tokens=5, messages=messages, tool_choice={"type": "none"}, **body)
    assert second.usage.input_tokens == len(expected)
    assert [b.type for b in second.content] == ["text"] and second.stop_reason in ("end_turn", "max_tokens")
    # The block echoed back as a dict, with the client's newer optional fields null: they ask for nothing.
    echoed = {**block.model_dump(), "caller": None, "toolset_name": None}
    messages[-2] = {"role": "assistant", "content": [echoed]}
    assert client.messages.count_tokens(model=MODEL_NAME, messages=messages, tools=TOOLS).input_tokens == len(
        rendered_ids(DEFAULT_MODEL_DIR, reference, tools=OPENAI_TOOLS))
    with pytest.raises(anthropic.BadRequestError, match="caller"):
        client.messages.count_tokens(model=MODEL_NAME, tools=TOOLS,
                                     messages=messages[:-2] + [{"role": "assistant", "content": [
                                         {**echoed, "caller": "me"}]}, messages[-1]])


@pytest.fixture(scope="module")
def reasoning_server():
    server = LiveServer(DEFAULT_MODEL_DIR, reasoning_parser="deepseek_r1", chat_template=THINKING_TEMPLATE)
    yield server
    server.stop()


def test_reasoning_comes_back_as_a_thinking_block(reasoning_server):
    client = anthropic_client(reasoning_server)
    chat = openai_client(reasoning_server).chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=30,
                                                                   temperature=0).choices[0].message
    short = ask(client)  # the template's default: thinking on
    thinking = short.content[0]
    assert (thinking.type, thinking.thinking, thinking.signature) == ("thinking", chat.reasoning_content, "")
    assert [b.text for b in short.content[1:]] == ([chat.content] if chat.content else [])
    same_message(streamed(client, model=MODEL_NAME, max_tokens=30, messages=MESSAGES, extra_body=GREEDY)[0], short)


def test_thinking_switch_renders_as_the_template_says(reasoning_server):
    client = anthropic_client(reasoning_server)
    for enabled in (True, False):
        thinking = {"type": "enabled", "budget_tokens": 1024} if enabled else {"type": "disabled"}
        expected = rendered_ids(DEFAULT_MODEL_DIR, MESSAGES, chat_template=THINKING_TEMPLATE, thinking=enabled)
        assert client.messages.count_tokens(model=MODEL_NAME, messages=MESSAGES,
                                            thinking=thinking).input_tokens == len(expected)
    off = ask(client, thinking={"type": "disabled"})
    chat = openai_client(reasoning_server).chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=30, temperature=0,
        extra_body={"chat_template_kwargs": {"thinking": False}}).choices[0].message
    assert chat.reasoning_content is None  # the prompt closed the reasoning: all answer
    assert [(b.type, b.text) for b in off.content] == [("text", chat.content)]
