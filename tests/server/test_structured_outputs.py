"""Structured outputs through the openai client on the embedded model: response_format and vLLM's structured_outputs,
streaming and not; a bad spec is a 400 naming its field, and leaves nothing in the engine."""
import json
import re

import jsonschema
import openai
import pytest

from latentserve.assets import DEFAULT_MODEL_DIR
from latentserve.engine.detokenizer import load_tokenizer
from tests.engine.structured.schemas import SCHEMAS
from tests.server.conftest import MODEL_NAME, LiveServer

MESSAGES = [{"role": "user", "content": "Who begat whom?"}]


@pytest.fixture(scope="module")
def live():
    server = LiveServer(DEFAULT_MODEL_DIR, max_num_seqs=32)
    yield server
    server.stop()


@pytest.fixture
def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0)


def json_schema_format(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": strict}}


@pytest.mark.parametrize("index", [3, 9, 13, 16, 19])
def test_response_format_json_schema(client, index):
    for temperature in (0.0, 1.0):
        response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=150, seed=index,
                                                  temperature=temperature,
                                                  response_format=json_schema_format(SCHEMAS[index], strict=bool(index % 2)))
        choice = response.choices[0]
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[index])
        assert choice.finish_reason == "stop"


def test_streamed_deltas_reassemble_to_a_valid_output(client):
    chunks = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=150, stream=True,
                                            response_format=json_schema_format(SCHEMAS[15]))
    text, reasons = "", []
    for chunk in chunks:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reasons.append(choice.finish_reason)
    jsonschema.validate(json.loads(text), SCHEMAS[15])
    assert reasons[-1] == "stop"


def test_response_format_json_object(client):
    tokens = load_tokenizer(DEFAULT_MODEL_DIR).encode('"}', add_special_tokens=False)
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=60, temperature=0, response_format={"type": "json_object"},
        logit_bias={str(t): 30 for t in tokens})  # closes strings and the object as soon as allowed
    assert isinstance(json.loads(response.choices[0].message.content), dict)


def test_structured_outputs_field_on_chat_and_completions(client):
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=20, temperature=1.0,
                                          extra_body={"structured_outputs": {"choice": ["Moses", "Aaron"]}})
    assert chat.choices[0].message.content in ("Moses", "Aaron") and chat.choices[0].finish_reason == "stop"
    completion = client.completions.create(model=MODEL_NAME, prompt="And God said", max_tokens=20,
                                           extra_body={"structured_outputs": {"regex": r"\d{3}-\d{2}"}}, n=2, seed=1)
    for choice in completion.choices:
        assert re.fullmatch(r"\d{3}-\d{2}", choice.text) and choice.finish_reason == "stop"
    grammar = 'root ::= "yea" | "nay"'
    stream = client.completions.create(model=MODEL_NAME, prompt="And God said", max_tokens=20, stream=True,
                                       extra_body={"structured_outputs": {"grammar": grammar}})
    assert "".join(c.choices[0].text for c in stream if c.choices) in ("yea", "nay")


@pytest.mark.parametrize("body, param, message", [
    (dict(response_format=json_schema_format({"type": "frobnicate"})), "response_format",
     'response_format.json_schema.schema: Unsupported type "frobnicate"'),
    (dict(response_format={"type": "json_schema"}), "response_format", "json_schema is required"),
    (dict(response_format={"type": "xml"}), "response_format", "response_format"),
    (dict(structured_outputs={"regex": "(?=a)b"}), "structured_outputs", "Lookahead is not supported"),
    (dict(structured_outputs={"choice": []}), "structured_outputs", "choice must not be empty"),
    (dict(structured_outputs={"grammar": "root ::= nothing"}), "structured_outputs", 'Rule "nothing" is not defined'),
    (dict(structured_outputs={"json": {"type": "string"}, "regex": "a"}), "structured_outputs", "exactly one of"),
    (dict(structured_outputs={"regex": "a", "whitespace_pattern": " "}), "structured_outputs", "whitespace_pattern"),
    (dict(structured_outputs={"regex": "a"}, response_format={"type": "json_object"}), "structured_outputs", "not both"),
    (dict(structured_outputs={"regex": "a"}, min_tokens=3), None, "min_tokens cannot be combined"),
])
def test_bad_spec_is_a_400_naming_its_field(live, client, body, param, message):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, extra_body=body)
    assert error.value.status_code == 400
    assert message in error.value.message
    if param is not None:
        assert error.value.body["param"] == param or param in error.value.message
    live.wait_idle()


def test_concurrent_requests_under_dbo_and_preemption():
    """Through the client: DBO splits the steps and a small KV pool preempts; every output still validates."""
    from concurrent.futures import ThreadPoolExecutor
    server = LiveServer(DEFAULT_MODEL_DIR, enable_dbo=True, dbo_decode_token_threshold=2,
                        dbo_prefill_token_threshold=2, num_kv_blocks=20, max_model_len=160, block_size=8)
    preempted = []
    scheduler = server.engine.scheduler
    original = scheduler._preempt
    scheduler._preempt = lambda request: (preempted.append(request.request_id), original(request))
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        indices = [9, 13, 15, 16, 19, 10, 14, 12]

        def ask(index: int):
            response = client.chat.completions.create(
                model=MODEL_NAME, messages=MESSAGES, max_tokens=120, temperature=0,
                response_format=json_schema_format(SCHEMAS[index]))
            return index, response.choices[0]

        with ThreadPoolExecutor(len(indices)) as pool:
            for index, choice in pool.map(ask, indices):
                jsonschema.validate(json.loads(choice.message.content), SCHEMAS[index])
                assert choice.finish_reason == "stop"
        assert preempted
    finally:
        server.stop()
