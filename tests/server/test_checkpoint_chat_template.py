"""The server renders a new architecture's chat template from its checkpoint folder: a tiny glm4_moe_lite model whose
folder carries a GLM-style `chat_template.jinja` with tools (as GLM's checkpoints publish it, taking precedence over
tokenizer_config.json's), checked against transformers' own rendering of the same folder."""
import shutil
from dataclasses import replace

import openai
import pytest

from latentserve.assets import DEFAULT_MODEL_DIR
from tests.server.conftest import MODEL_NAME, LiveServer
from tests.server.test_tool_parsers_glm_kimi import TOOLS

GLM_TEMPLATE = """[gMASK]<sop>{% if tools %}<|system|>
# Tools
{% for tool in tools %}{{ tool.function | tojson }}
{% endfor %}{% endif %}{% for m in messages %}<|{{ m.role }}|>
{{ m.content }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"""
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tests.models.arch_harness import make_arch_checkpoint
    from tests.models.test_arch_glm4_moe_lite import TestGlm4MoeLite

    case = replace(TestGlm4MoeLite.case, config={**TestGlm4MoeLite.case.config, "vocab_size": 4107})  # the tokenizer's
    path = make_arch_checkpoint(tmp_path_factory.mktemp("glm"), case)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL_DIR / name, path / name)
    (path / "chat_template.jinja").write_text(GLM_TEMPLATE)
    return path


def reference_ids(folder, tools) -> list[int]:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(folder)
    text = hf.apply_chat_template(MESSAGES, tools=tools, add_generation_prompt=True, tokenize=False)
    assert text.startswith("[gMASK]<sop>") and ("get_weather" in text) == bool(tools)
    return hf(text, add_special_tokens=False)["input_ids"]


def test_server_renders_the_checkpoint_template_with_tools(folder):
    server = LiveServer(folder, tool_call_parser="glm45")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        for tools in (TOOLS, None):
            extra = {"tools": tools} if tools else {}
            reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=1, **extra)
            assert reply.usage.prompt_tokens == len(reference_ids(folder, tools))
    finally:
        server.stop()
