"""Earlier turns' reasoning sent back (interleaved thinking): an assistant message's reasoning_content / reasoning on
chat and /tokenize, Anthropic's thinking blocks and the Responses API's reasoning items all reach the chat template as
the turn's reasoning_content, and the prompt equals transformers' rendering of the same conversation; what cannot be
read back is refused by name."""
from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from tests.glm_style_template import CALL, CONVERSATION, GLM_STYLE_TEMPLATE, renamed
from tests.server.conftest import API_KEY, MODEL_NAME, LiveServer


@pytest.fixture(scope="module")
def glm(model_dir):
    """The tiny checkpoint served with the GLM-style template, which keeps the reasoning of the current turns."""
    live = LiveServer(model_dir, chat_template=GLM_STYLE_TEMPLATE)
    yield live
    live.stop()


def post(server: LiveServer, path: str, **body) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": MODEL_NAME, **body}, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"})


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def reference(model_dir, messages: list[dict]) -> list[int]:
    """The conversation as transformers renders and tokenizes it with the same template: an independent reference."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return list(tokenizer.apply_chat_template(messages, chat_template=GLM_STYLE_TEMPLATE, add_generation_prompt=True,
                                              tokenize=True)["input_ids"])


def refused(response: httpx.Response, *words: str) -> None:
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert all(word in message for word in words), message


# The conversation with its reasoning under both names, the same text.
BOTH_NAMES = [{**m, "reasoning": m["reasoning_content"]} if "reasoning_content" in m else m for m in CONVERSATION]


@pytest.mark.parametrize("messages", [CONVERSATION, renamed(CONVERSATION, "reasoning"), BOTH_NAMES],
                         ids=["reasoning_content", "reasoning", "both"])
def test_chat_reasoning_renders_as_transformers(glm, model_dir, messages):
    want = reference(model_dir, CONVERSATION)
    text = AutoTokenizer.from_pretrained(model_dir).decode(want)
    assert "<think>r2</think>" in text and "r1" not in text  # the template's rule: only the current turns keep it
    assert ok(post(glm, "/tokenize", messages=messages))["tokens"] == want
    usage = ok(post(glm, "/v1/chat/completions", messages=messages, max_tokens=1, temperature=0))["usage"]
    assert usage["prompt_tokens"] == len(want)


@pytest.mark.parametrize("message, words", [
    ({"role": "user", "content": "hi", "reasoning_content": "r"}, ["reasoning_content", "only allowed in assistant"]),
    ({"role": "tool", "tool_call_id": "c1", "content": "ok", "reasoning": "r"}, ["reasoning", "assistant messages"]),
    ({"role": "assistant", "content": "a", "reasoning_content": "r", "reasoning": "s"},
     ["reasoning_content and reasoning differ"]),
])
def test_chat_refusals_name_the_keys(glm, message, words):
    for path in ("/tokenize", "/v1/chat/completions"):
        refused(post(glm, path, messages=[{"role": "user", "content": "hi"}, message], max_tokens=1), *words)


def test_a_template_that_reads_no_reasoning_renders_as_without_it(server):
    """The model's format has no place for it: the same prompt, as the template decides (no error)."""
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a1"}]
    sent = [plain[0], {**plain[1], "reasoning": "r1"}]
    tokens = [ok(post(server, "/tokenize", messages=messages))["tokens"] for messages in (sent, plain)]
    assert tokens[0] == tokens[1]


ANTHROPIC = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "r1", "signature": "s"},
                                      {"type": "text", "text": "a1"}]},
    {"role": "user", "content": "go"},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "r2", "signature": ""},
                                      {"type": "tool_use", "id": "c1", "name": "f", "input": {}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "ok"}]},
]


def test_anthropic_thinking_blocks_are_the_turns_reasoning(glm, model_dir):
    counted = ok(post(glm, "/v1/messages/count_tokens", messages=ANTHROPIC))["input_tokens"]
    assert counted == len(reference(model_dir, CONVERSATION))
    # Two thinking blocks of one turn (interleaved thinking) are one reasoning, a blank line between them.
    split = ANTHROPIC[:3] + [{"role": "assistant", "content": [
        {"type": "thinking", "thinking": "r2"}, {"type": "tool_use", "id": "c1", "name": "f", "input": {}},
        {"type": "thinking", "thinking": "r3"}]}, ANTHROPIC[4]]
    joined = CONVERSATION[:3] + [{**CONVERSATION[3], "reasoning_content": "r2\n\nr3"}, CONVERSATION[4]]
    assert ok(post(glm, "/v1/messages/count_tokens", messages=split))["input_tokens"] == len(
        reference(model_dir, joined))
    answer = ok(post(glm, "/v1/messages", messages=ANTHROPIC, max_tokens=1, temperature=0))
    assert answer["usage"]["input_tokens"] == counted


def test_anthropic_redacted_thinking_is_refused(glm):
    redacted = {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "xyz"},
                                                 {"type": "text", "text": "a1"}]}
    response = post(glm, "/v1/messages", messages=[ANTHROPIC[0], redacted, ANTHROPIC[2]], max_tokens=1)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert "block 0 is redacted_thinking" in response.json()["error"]["message"]
    assert "cannot decode" in response.json()["error"]["message"]


def _reasoning(text: str, part: str = "reasoning_text") -> dict:
    """A reasoning item as this server returns it (content) or as a summary only."""
    parts = [{"type": part, "text": text}]
    if part == "summary_text":
        return {"type": "reasoning", "id": "rs_1", "summary": parts}
    return {"type": "reasoning", "id": "rs_1", "summary": [], "content": parts, "status": "completed"}


RESPONSES = [
    {"role": "user", "content": "hi"},
    _reasoning("r1"),
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a1", "annotations": []}]},
    {"role": "user", "content": "go"},
    _reasoning("r2", "summary_text"),
    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "c1", "output": "ok"},
]


def test_responses_reasoning_items_are_the_next_turns_reasoning(glm, model_dir):
    def input_tokens(items: list[dict]) -> int:
        response = ok(post(glm, "/v1/responses", input=items, max_output_tokens=1, temperature=0))
        return response["usage"]["input_tokens"]

    assert input_tokens(RESPONSES) == len(reference(model_dir, CONVERSATION))
    # Two reasoning items before one turn are one reasoning, a blank line between them; a call joining the
    # assistant's text brings its reasoning after the text's.
    two = RESPONSES[:4] + [_reasoning("r2"), _reasoning("r3", "summary_text")] + RESPONSES[5:]
    joined = CONVERSATION[:3] + [{**CONVERSATION[3], "reasoning_content": "r2\n\nr3"}, CONVERSATION[4]]
    assert input_tokens(two) == len(reference(model_dir, joined))
    text_then_call = RESPONSES[:4] + [_reasoning("r2"), {"role": "assistant", "content": "a2"}, _reasoning("r3"),
                                      *RESPONSES[5:]]
    joined = CONVERSATION[:3] + [{**CONVERSATION[3], "content": "a2", "reasoning_content": "r2\n\nr3",
                                  "tool_calls": [CALL]}, CONVERSATION[4]]
    assert input_tokens(text_then_call) == len(reference(model_dir, joined))


@pytest.mark.parametrize("items, words", [
    ([_reasoning("r1"), {"role": "user", "content": "hi"}], ["item 0 is a reasoning item without"]),
    ([{"role": "user", "content": "hi"}, _reasoning("r1")], ["item 1 is a reasoning item without"]),
    ([{"role": "user", "content": "hi"}, {**_reasoning("r1"), "encrypted_content": "gAAA"},
      {"role": "assistant", "content": "a"}], ["encrypted_content cannot be decoded"]),
])
def test_responses_refusals(glm, items, words):
    refused(post(glm, "/v1/responses", input=items, max_output_tokens=1), *words)
