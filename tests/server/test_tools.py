"""Tool calling: the deepseek_v3 parser on synthetic outputs, bounded schemas, and tool_choice none / auto / required /
named end to end through the openai client on the embedded model (constrained decoding makes its calls valid)."""
import json

import jsonschema
import openai
import pytest

from latentserve.assets import DEFAULT_MODEL_DIR
from latentserve.engine.chat_template import render_chat
from latentserve.engine.detokenizer import load_tokenizer
from latentserve.server.tool_parsers import get_tool_parser
from latentserve.server.tools import MAX_ARRAY_ITEMS, MAX_CALLS, MAX_STRING_LENGTH, bound_schema
from tests.server.conftest import MODEL_NAME, LiveServer

PARSER = get_tool_parser("deepseek_v3")()
B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"


def call(name: str, arguments: str) -> str:
    return f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{arguments}\n```<｜tool▁call▁end｜>"


OUTPUT = "Let me look." + B + call("get_verse", '{"book": "John", "chapter": 3}') + call("get_weather", "{}") + E


def test_deepseek_v3_parser_whole_output():
    content, calls = PARSER.extract_tool_calls(OUTPUT)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_verse", {"book": "John", "chapter": 3}),
                                                                  ("get_weather", {})]
    assert PARSER.extract_tool_calls("No calls here.") == ("No calls here.", [])


def test_deepseek_v3_parser_partial_output_holds_back_and_closes_calls_one_by_one():
    seen_calls, previous_content = 0, ""
    for cut in range(1, len(OUTPUT) + 1):
        content, calls = PARSER.extract_tool_calls(OUTPUT[:cut], partial=cut < len(OUTPUT))
        assert (content or "").startswith(previous_content) and "<｜" not in (content or "")
        assert len(calls) >= seen_calls
        previous_content, seen_calls = content or "", len(calls)
    assert seen_calls == 2


def test_required_calls_close_one_by_one_in_a_growing_array():
    from latentserve.server.tools import ToolPlan
    calls = [{"name": "a", "parameters": {"s": 'x}\\"y]{', "n": [1, {"k": 2}]}}, {"name": "b", "parameters": {}}]
    text = json.dumps(calls, separators=(",", ":"))
    plan, seen = ToolPlan("required"), []
    for cut in range(len(text) + 1):
        content, found = plan.parse(text[:cut], None, partial=cut < len(text))
        assert content is None and [(c.name, json.loads(c.arguments)) for c in found] == [
            (c["name"], c["parameters"]) for c in calls[:len(found)]]
        seen.append(len(found))
    assert seen == sorted(seen) and seen[-1] == 2 and 1 in seen


def test_bound_schema_bounds_free_strings_and_arrays_only():
    schema = {"type": "object", "properties": {
        "free": {"type": "string"}, "enum": {"type": "string", "enum": ["a"]}, "short": {"type": "string", "maxLength": 3},
        "list": {"type": "array", "items": {"type": "string"}}, "nested": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
        "$defs": {"x": {"type": "string"}}}
    bounded = bound_schema(schema)
    props = bounded["properties"]
    assert props["free"]["maxLength"] == MAX_STRING_LENGTH and "maxLength" not in props["enum"]
    assert props["short"]["maxLength"] == 3
    assert props["list"]["maxItems"] == MAX_ARRAY_ITEMS and props["list"]["items"]["maxLength"] == MAX_STRING_LENGTH
    assert props["nested"]["anyOf"][0]["maxLength"] == MAX_STRING_LENGTH
    assert bounded["$defs"]["x"]["maxLength"] == MAX_STRING_LENGTH
    assert "maxLength" not in schema["properties"]["free"]  # the request's own schema is left alone


VERSE = {"type": "object", "properties": {"book": {"type": "string", "maxLength": 10},
                                          "chapter": {"type": "integer", "minimum": 1, "maximum": 150}},
         "required": ["book", "chapter"]}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
           "required": ["city"]}
NOTE = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}  # a free string
TOOLS = [{"type": "function", "function": {"name": "get_verse", "description": "Look up a verse.", "parameters": VERSE}},
         {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "take_note", "parameters": NOTE}}]
SCHEMAS = {"get_verse": VERSE, "get_weather": WEATHER, "take_note": NOTE}
CALLABLE = TOOLS[:2]  # with all three the prompt leaves too little of the 512-token context
MESSAGES = [{"role": "user", "content": "Find John chapter 3."}]


@pytest.fixture(scope="module")
def live():
    server = LiveServer(DEFAULT_MODEL_DIR, tool_call_parser="deepseek_v3")
    yield server
    server.stop()


@pytest.fixture
def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0)


def check_calls(calls, names=None) -> list[tuple[str, dict]]:
    result = []
    for c in calls:
        arguments = json.loads(c.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[c.function.name])
        assert c.type == "function" and c.id
        result.append((c.function.name, arguments))
    assert calls and (names is None or {n for n, _ in result} <= names)
    return result


def streamed(client, **body):
    calls: dict[int, dict] = {}
    reason, content = None, ""
    for chunk in client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, stream=True, **body):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": "", "id": None})
                entry["id"] = entry["id"] or delta.id
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            reason = choice.finish_reason or reason
    return [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)], content, reason


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_returns_valid_calls(client, temperature):
    body = dict(tools=CALLABLE, tool_choice="required", temperature=temperature, seed=1, max_tokens=215)
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **body)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    whole = check_calls(choice.message.tool_calls)
    assert len(whole) <= MAX_CALLS
    calls, content, reason = streamed(client, **body)
    assert (calls, content, reason) == (whole, "", "tool_calls")


def test_required_with_parallel_tool_calls_false_makes_one_call(client):
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=CALLABLE, tool_choice="required",
                                              parallel_tool_calls=False, temperature=0, max_tokens=215)
    assert len(check_calls(response.choices[0].message.tool_calls)) == 1


def test_named_function(client):
    for name in ("get_weather", "take_note"):  # take_note's free string ends at the default bound at the latest
        tools = [t for t in TOOLS if t["function"]["name"] == name]
        body = dict(tools=tools, tool_choice={"type": "function", "function": {"name": name}}, temperature=0,
                    max_tokens=100)
        choice = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **body).choices[0]
        assert choice.finish_reason == "stop" and choice.message.content is None
        whole = check_calls(choice.message.tool_calls, {name})
        assert streamed(client, **body) == (whole, "", "stop")


def test_none_and_auto_answer_in_text_when_the_model_does_not_call(client):
    for tool_choice in ("none", "auto"):
        choice = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS,
                                                tool_choice=tool_choice, temperature=0, max_tokens=8).choices[0]
        assert choice.message.content is not None and not choice.message.tool_calls
        assert choice.finish_reason in ("stop", "length")


def test_tool_results_round_trip_through_the_template(client):
    first = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=CALLABLE, tool_choice="required",
                                           temperature=0, max_tokens=215).choices[0].message
    messages = MESSAGES + [first.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": f"result of {c.function.name}"} for c in first.tool_calls]
    tokenizer = load_tokenizer(DEFAULT_MODEL_DIR)
    prompt = render_chat(tokenizer, messages, CALLABLE)
    for c in first.tool_calls:
        assert f"<｜tool▁sep｜>{c.function.name}\n```json\n{c.function.arguments}\n```" in prompt
        assert f"<｜tool▁output▁begin｜>result of {c.function.name}<｜tool▁output▁end｜>" in prompt
    assert prompt.endswith("<｜tool▁outputs▁end｜><|Assistant|>")
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert tokenizer.tokenizer.token_to_id("<｜tool▁output▁begin｜>") in ids  # one token each, as the model knows them
    second = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=CALLABLE, temperature=0,
                                            max_tokens=5, tool_choice="none")
    assert second.choices[0].message.content is not None and second.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body, param, message", [
    (dict(tools=[{"type": "function", "function": {"parameters": {}}}]), "tools", "name"),
    (dict(tools=[{"type": "function", "function": {"name": ""}}]), "tools", "name"),
    (dict(tools=TOOLS + TOOLS[:1]), "tools", "unique"),
    (dict(tool_choice="required"), "tool_choice", "needs tools"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "fly"}}), "tool_choice", "'fly'"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "frobnicate"}}}],
          tool_choice="required"), "tools", 'Unsupported type "frobnicate"'),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice",
     "cannot be combined"),
    (dict(messages=[{"role": "tool", "content": "x"}]), "messages", "tool_call_id"),
])
def test_bad_tool_requests_are_a_400(live, client, body, param, message):
    body = {"messages": MESSAGES, **body}
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL_NAME, max_tokens=5, **body)
    assert message in error.value.message
    assert param in (error.value.body.get("param") or "") or param in error.value.message
    live.wait_idle()


def test_auto_needs_a_tool_call_parser():
    server = LiveServer(DEFAULT_MODEL_DIR)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="--tool-call-parser"):
            client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=5)
    finally:
        server.stop()
