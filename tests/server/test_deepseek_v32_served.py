"""A server in tokenizer mode deepseek_v32 (DeepSeek-V3.2's recipe: its tool-call parser and deepseek_v3 reasoning):
chat and /tokenize render DeepSeek-V3.2's encoding, tool calls and results included; thinking is switched by
chat_template_kwargs (Anthropic's `thinking` too); what the encoding refuses comes back as a 400 naming the field."""
import httpx
import pytest

from latentserve.assets import DEFAULT_MODEL_DIR
from latentserve.engine.deepseek_v32_chat import tools_section  # its text is checked in tests/engine
from latentserve.engine.chat_template import render_chat
from latentserve.engine.detokenizer import load_tokenizer
from latentserve.engine.tokenizer_mode import apply_tokenizer_mode
from tests.server.conftest import MODEL_NAME, LiveServer

TOKENIZER = load_tokenizer(DEFAULT_MODEL_DIR)
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
HI = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call-1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]}
RESULT = {"role": "tool", "tool_call_id": "call-1", "content": "noon"}


@pytest.fixture(scope="module")
def server():
    live = LiveServer(DEFAULT_MODEL_DIR, tokenizer_mode="deepseek_v32", tool_call_parser="deepseek_v32",
                      reasoning_parser="deepseek_v3")
    yield live
    live.stop()


def post(server, path: str, **body) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": MODEL_NAME, **body}, timeout=60)


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("thinking", [False, True])
def test_tokenize_renders_the_encoding(server, thinking):
    response = post(server, "/tokenize", messages=HI, chat_template_kwargs={"thinking": thinking})
    assert response.status_code == 200, response.text
    assert response.json()["tokens"] == ids(f"{BOS}<｜User｜>hi<｜Assistant｜>{'<think>' if thinking else '</think>'}")


def test_chat_after_a_tool_call_and_its_result(server):
    calls = ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_time">\n'
             '<｜DSML｜parameter name="zone" string="true">UTC</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
             '</｜DSML｜function_calls>')
    prompt = (f"<｜User｜>hi<｜Assistant｜></think>\n\n{calls}{EOS}"
              "\n\n<function_results>\n<result>noon</result>\n</function_results>\n\n</think>")
    # The tools section alone outgrows the tiny model's context: with tools, the refusal counts the prompt's tokens.
    response = post(server, "/v1/chat/completions", messages=[*HI, CALL, RESULT], tools=TOOLS, max_tokens=4)
    assert response.status_code == 400, response.text
    count = len(ids(f"{BOS}\n\n{tools_section(TOOLS)}{prompt}"))
    assert f"the prompt has {count} tokens" in response.json()["error"]["message"]
    response = post(server, "/v1/chat/completions", messages=[*HI, CALL, RESULT], max_tokens=4, temperature=0)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len(ids(BOS + prompt))
    message = response.json()["choices"][0]["message"]
    assert message["reasoning_content"] is None  # thinking off: the prompt closed the reasoning


def test_anthropic_thinking_switches_the_encoding(server):
    for thinking, opening in (({"type": "enabled", "budget_tokens": 1024}, "<think>"), ({"type": "disabled"}, "</think>")):
        response = post(server, "/v1/messages/count_tokens", messages=HI, thinking=thinking)
        assert response.status_code == 200, response.text
        assert response.json()["input_tokens"] == len(ids(f"{BOS}<｜User｜>hi<｜Assistant｜>{opening}"))


@pytest.mark.parametrize("body, param, words", [
    ({"messages": HI, "chat_template_kwargs": {"enable_reasoning": True}}, "chat_template_kwargs",
     "reads no variable 'enable_reasoning'"),
    ({"messages": [*HI, {"role": "assistant", "content": "Hello."}]}, "messages",
     "add_generation_prompt: in the DeepSeek-V3.2 chat format"),
    ({"messages": [*HI, CALL, {**RESULT, "tool_call_id": "call-9"}]}, "messages",
     "the result of call 'call-9' stands where the format expects the result of call 'call-1'"),
])
def test_refusals_name_the_field(server, body, param, words):
    response = post(server, "/v1/chat/completions", max_tokens=4, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_a_chat_template_besides_the_mode_is_refused():
    with pytest.raises(ValueError, match="give one of the two"):
        LiveServer(DEFAULT_MODEL_DIR, tokenizer_mode="deepseek_v32", chat_template="{{ messages }}")


@pytest.mark.parametrize("key", ["reasoning_content", "reasoning"])
def test_reasoning_sent_back_reaches_the_encoding(server, key):
    """Thinking on: the tool-calling turn after the last user message keeps the reasoning it was sent back with."""
    messages = [*HI, {**CALL, key: "Need the time."}, RESULT]
    response = post(server, "/tokenize", messages=messages, chat_template_kwargs={"thinking": True})
    assert response.status_code == 200, response.text
    encoding = apply_tokenizer_mode(TOKENIZER, "deepseek_v32", DEFAULT_MODEL_DIR)
    text = render_chat(encoding, [*HI, {**CALL, "reasoning_content": "Need the time."}, RESULT],
                       chat_template_kwargs={"thinking": True})
    assert "<｜Assistant｜><think>Need the time.</think>" in text
    assert response.json()["tokens"] == ids(text)
