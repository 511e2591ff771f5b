"""Chat requests' rendering options (vLLM's add_generation_prompt, continue_final_message, chat_template_kwargs and
--default-chat-template-kwargs) served, and the reasoning parser following a template that turns thinking off: the
prompt then ends in `</think>`, the whole output is the answer, and a structured-output constraint applies from its
first token."""
import json
from dataclasses import replace

import httpx
import jsonschema
import pytest

from latentserve.assets import DEFAULT_MODEL_DIR
from latentserve.engine.chat_template import render_chat
from latentserve.engine.detokenizer import load_tokenizer
from latentserve.engine.reasoning import get_reasoning_parser, parser_for_prompt
from latentserve.server import build_app
from tests.engine.structured.schemas import SCHEMAS
from tests.engine.test_chat_template import THINKING
from tests.server.conftest import MODEL_NAME, LiveServer

TOKENIZER = load_tokenizer(DEFAULT_MODEL_DIR)
PARSER = get_reasoning_parser("deepseek_v3")(TOKENIZER)
MESSAGES = [{"role": "user", "content": "Think."}]


def _ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("prompt, parsed", [
    ("<|User|>Hi<|Assistant|></think>", False),  # thinking off: the answer follows at once
    ("<|User|>Hi<|Assistant|></think>\n\n", False),
    ("<|User|>Hi<|Assistant|><think>", True),
    ("<|User|>Hi</think>x<|Assistant|>", True),  # an earlier turn's end is not this output's
])
def test_parser_for_prompt(prompt, parsed):
    assert (parser_for_prompt(PARSER, _ids(prompt)) is PARSER) is parsed
    assert parser_for_prompt(None, _ids(prompt)) is None


@pytest.fixture(scope="module")
def servers():
    """A deepseek_v3 reasoning server (thinking on by default) and one without a parser, both on the thinking
    template."""
    parsed = LiveServer(DEFAULT_MODEL_DIR, reasoning_parser="deepseek_v3", chat_template=THINKING,
                        default_chat_template_kwargs={"thinking": True})
    plain = LiveServer(DEFAULT_MODEL_DIR, chat_template=THINKING)
    yield parsed, plain
    parsed.stop()
    plain.stop()


def _chat(server, **body) -> httpx.Response:
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 24, "temperature": 0, **body}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def _message(server, **body) -> dict:
    response = _chat(server, **body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]


def _tokens(server, **body) -> list[int]:
    response = httpx.post(f"{server.url}/tokenize", json={"model": MODEL_NAME, **body}, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def test_default_kwargs_and_a_requests_own(servers):
    parsed, _ = servers
    think, end = TOKENIZER.tokenizer.token_to_id("<think>"), TOKENIZER.tokenizer.token_to_id("</think>")
    assert _tokens(parsed, messages=MESSAGES)[-1] == think
    assert _tokens(parsed, messages=MESSAGES, chat_template_kwargs={"thinking": False})[-1] == end
    reference = replace(TOKENIZER, chat_template=THINKING)
    assert _tokens(parsed, messages=MESSAGES) == _ids(render_chat(reference, MESSAGES, chat_template_kwargs={
        "thinking": True}))


def test_thinking_off_is_all_answer(servers):
    parsed, plain = servers
    raw = _message(plain)["content"]  # the plain server's default: thinking off
    off = _message(parsed, chat_template_kwargs={"thinking": False})
    assert (off["reasoning_content"], off["content"]) == (None, raw)
    stream = httpx.post(f"{parsed.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 24, "temperature": 0, "stream": True,
        "chat_template_kwargs": {"thinking": False}})
    deltas = [json.loads(line[6:])["choices"] for line in stream.text.splitlines()
              if line.startswith("data: {")]
    content = "".join(c[0]["delta"].get("content") or "" for c in deltas if c)
    assert content == raw and not any(c and c[0]["delta"].get("reasoning_content") for c in deltas)


def test_thinking_on_splits_at_the_end_of_the_reasoning(servers):
    parsed, plain = servers
    raw = _message(plain, chat_template_kwargs={"thinking": True})["content"]
    on = _message(parsed)
    if "</think>" in raw:
        assert (on["reasoning_content"] or "") + "</think>" + (on["content"] or "") == raw
    else:
        assert (on["reasoning_content"], on["content"]) == (raw, None)


def test_thinking_off_constrains_from_the_first_token(servers):
    """The tiny model never writes `</think>` itself: had the parser waited for it, the schema would never apply."""
    parsed, _ = servers
    schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMAS[9]}}
    off = _message(parsed, chat_template_kwargs={"thinking": False}, response_format=schema, max_tokens=120)
    assert off["reasoning_content"] is None
    jsonschema.validate(json.loads(off["content"]), SCHEMAS[9])


def test_continue_final_message(servers):
    _, plain = servers
    messages = [*MESSAGES, {"role": "assistant", "content": "And Seth "}]
    reference = replace(TOKENIZER, chat_template=THINKING)
    expected = _ids(render_chat(reference, messages, add_generation_prompt=False, continue_final_message=True))
    assert _tokens(plain, messages=messages, add_generation_prompt=False, continue_final_message=True) == expected
    usage = _chat(plain, messages=messages, add_generation_prompt=False, continue_final_message=True).json()["usage"]
    assert usage["prompt_tokens"] == len(expected)
    ended = _tokens(plain, messages=messages, add_generation_prompt=False)
    assert ended == _ids(render_chat(reference, messages, add_generation_prompt=False))


@pytest.mark.parametrize("body, param, message", [
    (dict(chat_template_kwargs={"enable_thinking": False}), "chat_template_kwargs",
     "reads no variable 'enable_thinking' (the variables it reads: thinking)"),
    (dict(chat_template_kwargs={"tools": []}), "chat_template_kwargs", "'tools' is set by tools"),
    (dict(continue_final_message=True), "continue_final_message", "needs add_generation_prompt=false"),
    (dict(continue_final_message=True, add_generation_prompt=False), "messages", "the last message must be"),
])
def test_bad_options_are_refused_by_name(servers, body, param, message):
    response = _chat(servers[0], **body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == param


def test_default_kwargs_the_template_does_not_read_fail_at_start(servers):
    with pytest.raises(ValueError, match="reads no variable 'enable_thinking'"):
        build_app(servers[1].engine, MODEL_NAME, chat_template=THINKING,
                  default_chat_template_kwargs={"enable_thinking": True})


def test_chat_fields_with_a_prompt_are_refused(servers):
    response = httpx.post(f"{servers[1].url}/tokenize", timeout=30, json={
        "model": MODEL_NAME, "prompt": "hi", "chat_template_kwargs": {"thinking": True}})
    assert response.status_code == 400
    assert "chat_template_kwargs: renders messages; this request sends a prompt" in response.json()["error"]["message"]
