"""OpenAI's Responses API through the official openai client against live servers: answers equal the chat endpoint's
for the same conversation, prompts equal transformers' rendering of it, streams reassemble to the whole response."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from latentserve.assets import DEFAULT_MODEL_DIR
from tests.server.conftest import API_KEY, MODEL_NAME, LiveServer
from tests.server.test_anthropic_messages import THINKING_TEMPLATE, WEATHER, rendered_ids

QUESTION = "Name a color!"
MESSAGES = [{"role": "user", "content": QUESTION}]
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER,
          "strict": True}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                                "parameters": WEATHER, "strict": True}}]
FORCED = {"type": "function", "name": "get_weather"}
COLOR = {"type": "object", "properties": {"color": {"type": "string", "maxLength": 12}}, "required": ["color"],
         "additionalProperties": False}


def client_of(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def respond(client: openai.OpenAI, **body) -> openai.types.responses.Response:
    return client.responses.create(**{"model": MODEL_NAME, "input": QUESTION, "max_output_tokens": 30,
                                      "temperature": 0, **body})


def chat(client: openai.OpenAI, messages: list[dict], **body):
    return client.chat.completions.create(model=MODEL_NAME, messages=messages, temperature=0,
                                          **{"max_tokens": 30, **body})


def streamed(client: openai.OpenAI, **body) -> tuple[list, openai.types.responses.Response]:
    """The events of a streamed response, and the response they assemble to: the text and arguments deltas
    concatenated into each item, in the items' order."""
    events = list(respond(client, stream=True, **body))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert [event.type for event in events[:2]] == ["response.created", "response.in_progress"]
    final = events[-1].response
    assert events[-1].type == f"response.{final.status}" and final.status in ("completed", "incomplete")
    pieces: dict[str, str] = {}
    for event in events:
        if event.type.endswith(".delta"):
            pieces[event.item_id] = pieces.get(event.item_id, "") + event.delta
    done = [event.item for event in events if event.type == "response.output_item.done"]
    assert done == final.output
    for item in final.output:
        whole = item.arguments if item.type == "function_call" else item.content[0].text
        assert pieces.get(item.id, "") == whole
    return events, final


def _comparable(response) -> dict:
    """The response without its ids and times, new in each, its cached tokens, which the first run left, and what the
    client's stream helper adds (parsed_arguments)."""
    ids = {"id", "call_id", "created_at", "completed_at", "parsed_arguments"}
    body = {k: v for k, v in response.to_dict().items() if k not in ids}
    body["output"] = [{k: v for k, v in item.items() if k not in ids} for item in body["output"]]
    del body["usage"]["input_tokens_details"]["cached_tokens"]
    return body


def same_response(streamed_response, whole) -> None:
    assert _comparable(streamed_response) == _comparable(whole)


@pytest.fixture
def client(server) -> openai.OpenAI:
    return client_of(server)


def test_reply_equals_the_chat_endpoints(client, model_dir):
    for instructions in (None, "Be brief."):
        messages = ([{"role": "system", "content": instructions}] if instructions else []) + MESSAGES
        expected = chat(client, messages)
        as_items = [{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
        for question in (QUESTION, as_items):
            response = respond(client, input=question, **({"instructions": instructions} if instructions else {}))
            assert response.object == "response" and response.id.startswith("resp_") and response.model == MODEL_NAME
            assert [item.type for item in response.output] == ["message"]
            assert response.output_text == expected.choices[0].message.content
            usage = response.usage
            assert usage.input_tokens == expected.usage.prompt_tokens == len(rendered_ids(model_dir, messages))
            assert usage.output_tokens == expected.usage.completion_tokens
            assert usage.total_tokens == usage.input_tokens + usage.output_tokens
            assert usage.output_tokens_details.reasoning_tokens == 0
            status = {"stop": "completed", "length": "incomplete"}[expected.choices[0].finish_reason]
            assert response.status == status and response.instructions == instructions
            assert response.to_dict()["store"] is False


def test_max_output_tokens_makes_the_response_incomplete(client):
    text = respond(client).output_text
    short = respond(client, max_output_tokens=3)
    assert (short.status, short.incomplete_details.reason, short.usage.output_tokens) == (
        "incomplete", "max_output_tokens", 3)
    assert text.startswith(short.output_text) and len(short.output_text) < len(text)
    assert short.output[-1].status == "incomplete"  # the item being written when the output was cut
    _, final = streamed(client, max_output_tokens=3)
    assert final.output[-1].status == "incomplete"


def test_stream_reassembles_the_response(client):
    for body in ({}, {"max_output_tokens": 3}, {"instructions": "Be brief."}):
        _, final = streamed(client, **body)
        same_response(final, respond(client, **body))


def test_raw_events_are_named_by_their_type(server):
    body = {"model": MODEL_NAME, "input": QUESTION, "max_output_tokens": 5, "stream": True, "temperature": 0}
    response = httpx.post(f"{server.url}/v1/responses", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                          timeout=30)
    events = [block.split("\n") for block in response.text.strip().split("\n\n")]
    for name, data in events:
        assert json.loads(data.removeprefix("data: "))["type"] == name.removeprefix("event: ")
    assert events[-1][0] == "event: response.incomplete"  # no [DONE] after it


@pytest.mark.parametrize("body, param, words", [
    ({"extra_body": {"frobnicate": 1}}, "frobnicate", ["frobnicate"]),
    ({"previous_response_id": "resp_1"}, "previous_response_id", ["previous_response_id", "stores no responses"]),
    ({"store": True}, "store", ["store", "stores no responses"]),
    ({"tools": [{"type": "web_search"}]}, "tools", ["'web_search'", "function tools only"]),
    ({"reasoning": {"effort": "low"}}, "reasoning", ["reasoning", "--reasoning-parser"]),
    ({"truncation": "auto"}, "truncation", ["truncation", "'auto'"]),
    ({"include": ["reasoning.encrypted_content"]}, "include", ["include"]),
    ({"background": True}, "background", ["background"]),
    ({"tool_choice": "required"}, "tool_choice", ["tool_choice", "needs tools"]),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/a.png"}]}]}, "input",
     ["input_image", "content part 0"]),
    ({"input": [{"type": "file_search_call", "id": "x"}]}, "input", ["item 0", "'file_search_call'"]),
])
def test_errors_name_the_field(server, client, body, param, words):
    with pytest.raises(openai.BadRequestError) as error:
        respond(client, **body)
    info = error.value.body
    assert info["type"] == "invalid_request_error" and info["param"] == param, info
    assert all(word in info["message"] for word in words), info
    server.wait_idle()


@pytest.fixture(scope="module")
def tools_server():
    server = LiveServer(DEFAULT_MODEL_DIR, tool_call_parser="deepseek_v3")
    yield server
    server.stop()


def test_forced_function_call_equals_the_named_chat_call(tools_server):
    client = client_of(tools_server)
    response = respond(client, tools=TOOLS, tool_choice=FORCED, max_output_tokens=60)
    [call] = chat(client, MESSAGES, max_tokens=60, tools=CHAT_TOOLS, tool_choice={
        "type": "function", "function": {"name": "get_weather"}}).choices[0].message.tool_calls
    [item] = response.output
    assert (item.type, item.name, item.arguments, item.status) == ("function_call", "get_weather",
                                                                   call.function.arguments, "completed")
    jsonschema.validate(json.loads(item.arguments), WEATHER)
    assert response.status == "completed" and response.tool_choice.name == "get_weather"
    with client.responses.stream(model=MODEL_NAME, input=QUESTION, max_output_tokens=60, temperature=0, tools=TOOLS,
                                 tool_choice=FORCED) as stream:
        same_response(stream.get_final_response(), response)
    _, final = streamed(client, tools=TOOLS, tool_choice=FORCED, max_output_tokens=60)
    same_response(final, response)


def test_function_call_output_renders_as_the_chat_paths_tool_message(tools_server):
    client = client_of(tools_server)
    first = respond(client, tools=TOOLS, tool_choice=FORCED, max_output_tokens=60)
    [call] = first.output
    conversation = [{"role": "user", "content": QUESTION}, *first.output,
                    {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"},
                    {"role": "user", "content": "And tomorrow?"}]
    second = respond(client, input=conversation, tools=TOOLS, tool_choice="none", max_output_tokens=5)
    # The chat path's conversation: the model's own call, its result as a tool message, the user's text after it.
    reference = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny"},
        {"role": "user", "content": "And tomorrow?"}]
    expected = chat(client, reference, max_tokens=5, tools=CHAT_TOOLS, tool_choice="none")
    assert second.usage.input_tokens == expected.usage.prompt_tokens == len(
        rendered_ids(DEFAULT_MODEL_DIR, reference, tools=CHAT_TOOLS))
    assert second.output_text == expected.choices[0].message.content
    # The call echoed back as a dict with the client's newer optional fields null: they ask for nothing.
    echoed = {**call.model_dump(exclude_none=True), "caller": None, "namespace": None}
    conversation[1] = echoed
    again = respond(client, input=conversation, tools=TOOLS, tool_choice="none", max_output_tokens=5)
    assert again.usage.input_tokens == second.usage.input_tokens
    with pytest.raises(openai.BadRequestError, match="caller"):
        respond(client, input=[*conversation[:1], {**echoed, "caller": "me"}, *conversation[2:]], tools=TOOLS,
                tool_choice="none", max_output_tokens=5)


def test_json_schema_text_format_validates(tools_server):
    client = client_of(tools_server)
    schema = {"name": "color", "schema": COLOR, "strict": True}
    response = respond(client, text={"format": {"type": "json_schema", **schema}}, max_output_tokens=60)
    assert response.status == "completed" and response.text.format.type == "json_schema"
    jsonschema.validate(json.loads(response.output_text), COLOR)
    expected = chat(client, MESSAGES, max_tokens=60, response_format={"type": "json_schema", "json_schema": schema})
    assert response.output_text == expected.choices[0].message.content


@pytest.fixture(scope="module")
def reasoning_server():
    server = LiveServer(DEFAULT_MODEL_DIR, reasoning_parser="deepseek_r1", chat_template=THINKING_TEMPLATE)
    yield server
    server.stop()


def test_reasoning_comes_back_as_a_reasoning_item(reasoning_server):
    client = client_of(reasoning_server)
    expected = chat(client, MESSAGES).choices[0].message
    response = respond(client)
    reasoning = response.output[0]
    assert (reasoning.type, [part.text for part in reasoning.content]) == ("reasoning", [expected.reasoning_content])
    assert response.output_text == (expected.content or "")
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    _, final = streamed(client)
    same_response(final, response)
