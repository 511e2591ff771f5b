"""The glm45 and kimi_k2 tool parsers behind the server: a regex structured output forces the embedded model to write
a hand-written output in each format, and the openai client must get the calls, whole and streamed."""
import json
import re

import openai
import pytest

from latentserve.assets import DEFAULT_MODEL_DIR
from tests.server.conftest import MODEL_NAME, LiveServer
from tests.server.test_tool_parsers_glm_kimi import TOOLS, glm_call, kimi_calls

CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]
OUTPUTS = {"glm45": "Checking.\n" + "".join(glm_call(name, arguments) for name, arguments in CALLS),
           "kimi_k2": "Checking." + kimi_calls(*[(name, json.dumps(arguments)) for name, arguments in CALLS])}
CONTENT = {"glm45": "Checking.\n", "kimi_k2": "Checking."}


@pytest.fixture(scope="module", params=sorted(OUTPUTS))
def served(request):
    server = LiveServer(DEFAULT_MODEL_DIR, tool_call_parser=request.param)
    yield request.param, openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    server.stop()


def escape(text: str) -> str:
    """A regex matching `text` alone (re.escape also escapes characters the grammar engine does not know escaped)."""
    return re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", text)


def body(parser: str) -> dict:
    return dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
                max_tokens=300, temperature=0.0,
                extra_body={"structured_outputs": {"regex": escape(OUTPUTS[parser])}})


def test_calls_whole(served):
    parser, client = served
    choice = client.chat.completions.create(**body(parser)).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == CONTENT[parser]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == CALLS
    assert len({c.id for c in choice.message.tool_calls}) == 2


def test_calls_streamed(served):
    parser, client = served
    calls, content, reason = {}, "", None
    for chunk in client.chat.completions.create(stream=True, **body(parser)):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            reason = choice.finish_reason or reason
    assert reason == "tool_calls" and content == CONTENT[parser]
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == CALLS
