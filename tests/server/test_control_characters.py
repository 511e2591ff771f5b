"""Structured outputs and tool calls never hold raw control characters, which JSON forbids unescaped: with the tokens
that decode to U+0000-U+001F pushed up by logit_bias, every output still parses with a strict JSON parser and
validates against its schema (strings, keys, enums, tool arguments; json_schema, json_object, tools)."""
import json
import re

import jsonschema
import openai
import pytest

from latentserve.assets import DEFAULT_MODEL_DIR
from latentserve.engine.detokenizer import load_tokenizer
from tests.server.conftest import MODEL_NAME, LiveServer

MESSAGES = [{"role": "user", "content": "Who begat whom?"}]
CONTROL = re.compile(r"[\x00-\x1f]")


def control_token_ids() -> list[int]:
    tokenizer = load_tokenizer(DEFAULT_MODEL_DIR)
    ids = [i for i in range(tokenizer.tokenizer.get_vocab_size())
           if len(text := tokenizer.decode([i], skip_special_tokens=False)) == 1 and CONTROL.match(text)]
    assert len(ids) == 32, ids  # the byte-level vocabulary has one token per control byte
    return ids


BIAS = {str(i): 30 for i in control_token_ids()}
NAME = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}}, "required": ["name"]}
SCHEMAS = {
    "bounded string": NAME,
    "min length": {"type": "object", "properties": {"name": {"type": "string", "minLength": 3, "maxLength": 8}},
                   "required": ["name"]},
    "bounded keys": {"type": "object", "propertyNames": {"maxLength": 6}, "additionalProperties": {"type": "boolean"},
                     "minProperties": 1, "maxProperties": 2},
    "enum": {"type": "object", "properties": {"tribe": {"enum": ["Judah", "Levi\u0001", "Dan"]}}, "required": ["tribe"]},
    "array of strings": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 3},
}
TOOL = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["text", "tags"]}}}


@pytest.fixture(scope="module")
def client():
    server = LiveServer(DEFAULT_MODEL_DIR, max_num_seqs=16)
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    server.stop()


def strict(text: str) -> object:
    assert not CONTROL.search(text), repr(text)
    return json.loads(text)  # strict=True: refuses control characters inside strings


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_hold_no_control_characters(client, name):
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=60, temperature=0, logit_bias=BIAS,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMAS[name]}})
    choice = response.choices[0]
    assert choice.finish_reason == "stop", repr(choice.message.content)
    jsonschema.validate(strict(choice.message.content), SCHEMAS[name])


def test_json_object_and_completions_structured_outputs(client):
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=40, temperature=0,
                                              logit_bias=BIAS, response_format={"type": "json_object"})
    text = response.choices[0].message.content
    assert not CONTROL.search(text), repr(text)
    if response.choices[0].finish_reason == "stop":
        assert isinstance(strict(text), dict)
    completion = client.completions.create(model=MODEL_NAME, prompt="And God said", max_tokens=60, temperature=0,
                                           logit_bias=BIAS, extra_body={"structured_outputs": {"json": NAME}})
    assert completion.choices[0].finish_reason == "stop"
    jsonschema.validate(strict(completion.choices[0].text), NAME)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "note"}}])
def test_tool_call_arguments_hold_no_control_characters(client, tool_choice):
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=300, temperature=0,
                                              logit_bias=BIAS, tools=[TOOL], tool_choice=tool_choice)
    calls = response.choices[0].message.tool_calls
    assert calls, response.choices[0]
    for call in calls:
        jsonschema.validate(strict(call.function.arguments), TOOL["function"]["parameters"])
