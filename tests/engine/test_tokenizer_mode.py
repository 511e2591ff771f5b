"""The tokenizer mode: deepseek_v32 renders every chat with DeepSeek-V3.2's encoding, auto with the chat template,
falling back to that encoding for a DeepSeek-V3.2 checkpoint that has none. A mode is checked before any model is
read, and a chat template given besides an explicit mode is refused."""
import json
import shutil
from pathlib import Path

import pytest

from latentserve import LLM, SamplingParams
from latentserve.assets import DEFAULT_MODEL_DIR
from latentserve.engine.chat_template import render_chat, with_chat_template
from latentserve.engine.engine_config import EngineConfig
from latentserve.engine.llm_engine import engine_tokenizer

HI = [{"role": "user", "content": "hi"}]
V32_PROMPT = "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜></think>"
TEMPLATE = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"


def checkpoint(path: Path, model_type: str, chat_template: bool) -> Path:
    """The embedded checkpoint's config (made DeepSeek-V3.2's if asked) and tokenizer, with or without its chat
    template; no weights (nothing here reads them)."""
    path.mkdir()
    config = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    if model_type == "deepseek_v32":
        config.update(model_type="deepseek_v32", architectures=["DeepseekV32ForCausalLM"], index_topk=8,
                      index_n_heads=4, index_head_dim=32)
    (path / "config.json").write_text(json.dumps(config))
    shutil.copy(DEFAULT_MODEL_DIR / "tokenizer.json", path)
    tokenizer_config = json.loads((DEFAULT_MODEL_DIR / "tokenizer_config.json").read_text())
    if not chat_template:
        del tokenizer_config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return path


def test_a_v32_checkpoint_without_a_template_gets_the_encoding(tmp_path):
    tokenizer = engine_tokenizer(checkpoint(tmp_path / "m", "deepseek_v32", False), None, "auto")
    assert render_chat(tokenizer, HI) == V32_PROMPT
    # Not asked for: a template given (--chat-template) takes its place.
    assert render_chat(with_chat_template(tokenizer, TEMPLATE), HI) == "[hi]"


def test_a_checkpoints_own_template_wins_in_auto_mode(tmp_path):
    tokenizer = engine_tokenizer(checkpoint(tmp_path / "m", "deepseek_v32", True), None, "auto")
    assert tokenizer.chat_encoding is None and render_chat(tokenizer, HI) != V32_PROMPT


def test_other_models_without_a_template_still_have_none(tmp_path):
    tokenizer = engine_tokenizer(checkpoint(tmp_path / "m", "deepseek_v3", False), None, "auto")
    with pytest.raises(ValueError, match="this model has no chat template"):
        render_chat(tokenizer, HI)


def test_the_mode_asked_for_renders_any_checkpoint_and_refuses_a_template():
    tokenizer = engine_tokenizer(DEFAULT_MODEL_DIR, None, "deepseek_v32")
    assert render_chat(tokenizer, HI) == V32_PROMPT
    with pytest.raises(ValueError, match="tokenizer mode 'deepseek_v32' renders chats with its own encoding: give one "
                                         "of the two"):
        with_chat_template(tokenizer, TEMPLATE)


@pytest.mark.parametrize("mode", ["slow", "mistral", None])
def test_other_modes_are_refused_naming_the_choices(mode):
    message = f"tokenizer_mode {mode!r} is not supported; use one of: auto, deepseek_v32"
    with pytest.raises(ValueError, match=message):
        EngineConfig(tokenizer_mode=mode)
    with pytest.raises(ValueError, match=message):
        LLM(tokenizer_mode=mode)  # before any model is read


def test_llm_chat_in_the_mode():
    llm = LLM(tokenizer_mode="deepseek_v32", max_num_seqs=2, num_kv_blocks=32, dtype="float32")
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    output = llm.chat(HI, greedy, use_tqdm=False)[0]
    assert output.prompt == V32_PROMPT
    assert output.prompt_token_ids == llm.get_tokenizer().encode(V32_PROMPT, add_special_tokens=False)
    thinking = llm.chat(HI, greedy, use_tqdm=False, chat_template_kwargs={"thinking": True})[0]
    assert thinking.prompt == V32_PROMPT.replace("</think>", "<think>")
    with pytest.raises(ValueError, match="give one of the two"):
        llm.chat(HI, greedy, chat_template=TEMPLATE)
