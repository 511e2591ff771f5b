"""The embedded default model is a genuine Hugging Face DeepSeek-V3 checkpoint that speaks KJV English."""
from __future__ import annotations

import importlib.util
import json
import re
import sys

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from latentserve.assets import DEFAULT_MODEL_DIR

transformers = pytest.importorskip("transformers")
import jinja2  # noqa: E402  (transformers' chat templates need it)
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    DeepseekV3ForCausalLM,
    PreTrainedTokenizerFast,
)

WEIGHTS = DEFAULT_MODEL_DIR / "model.safetensors"


@pytest.fixture(scope="module")
def model() -> DeepseekV3ForCausalLM:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer() -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


def test_config_is_small_mla_moe_deepseek_v3():
    cfg = AutoConfig.from_pretrained(DEFAULT_MODEL_DIR)
    assert cfg.model_type == "deepseek_v3"
    assert cfg.architectures == ["DeepseekV3ForCausalLM"]
    assert cfg.q_lora_rank is not None and cfg.kv_lora_rank < cfg.hidden_size
    assert 1 <= cfg.first_k_dense_replace < cfg.num_hidden_layers, "needs both dense and MoE layers"
    assert cfg.n_group > cfg.topk_group >= 1, "group-limited routing must actually drop groups"
    assert cfg.n_routed_experts % cfg.n_group == 0
    assert cfg.n_shared_experts >= 1 and not cfg.tie_word_embeddings
    assert cfg.rope_parameters["rope_type"] == "default"


def test_weights_stored_bf16_with_fp32_router_and_small():
    assert WEIGHTS.stat().st_size <= 25_000_000
    with safe_open(WEIGHTS, "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    router = {k for k in dtypes if ".mlp.gate." in k}
    assert router and all(dtypes[k] == "F32" for k in router)
    assert {dtypes[k] for k in dtypes if k not in router} == {"BF16"}


def test_loads_in_fp32_with_the_stored_values(model):
    assert isinstance(model, DeepseekV3ForCausalLM)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    state = model.state_dict()
    moe_layer = model.config.first_k_dense_replace
    prefix = f"model.layers.{moe_layer}.mlp"
    with safe_open(WEIGHTS, "pt") as f:
        for name in ("lm_head.weight", "model.embed_tokens.weight", f"{prefix}.gate.e_score_correction_bias",
                     f"model.layers.{moe_layer}.self_attn.kv_b_proj.weight"):
            torch.testing.assert_close(state[name], f.get_tensor(name).float(), rtol=0, atol=0)
        # Experts are stored per expert on disk (DeepSeek's layout) and fused into 3D tensors in transformers.
        last = model.config.n_routed_experts - 1
        gate_up = torch.cat([f.get_tensor(f"{prefix}.experts.{last}.{p}_proj.weight") for p in ("gate", "up")])
        torch.testing.assert_close(state[f"{prefix}.experts.gate_up_proj"][last], gate_up.float(), rtol=0, atol=0)
        bias = f.get_tensor(f"{prefix}.gate.e_score_correction_bias")
    assert bias.abs().max() > 0, "training should have balanced the experts through the correction bias"


def test_tokenizer_file_round_trips_text():
    tok = Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))
    text = "In the beginning God created the heaven and the earth.\n  Naïve café, 東京 & ∑ — tabs\tand 12345!"
    enc = tok.encode(text)
    assert enc.ids[0] == tok.token_to_id("<|begin_of_text|>")
    assert tok.decode(enc.ids, skip_special_tokens=True) == text
    assert tok.encode(text, add_special_tokens=False).ids == enc.ids[1:]


def test_auto_tokenizer_matches_tokenizer_file(hf_tokenizer, model):
    tok = Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))
    assert isinstance(hf_tokenizer, PreTrainedTokenizerFast)
    text = "And the LORD spake unto Moses, saying,"
    assert hf_tokenizer(text)["input_ids"] == tok.encode(text).ids
    ids = {hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id, hf_tokenizer.pad_token_id}
    assert None not in ids and len(ids) == 3
    assert (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id) == (model.config.bos_token_id,
                                                                       model.config.eos_token_id)
    assert len(hf_tokenizer) == model.config.vocab_size
    config = json.loads((DEFAULT_MODEL_DIR / "tokenizer_config.json").read_text())
    assert "{{" in config["chat_template"]


def test_chat_template_renders(hf_tokenizer):
    messages = [{"role": "system", "content": "Speak as the KJV."},
                {"role": "user", "content": "Who made the heaven?"},
                {"role": "assistant", "content": "God."},
                {"role": "user", "content": "And the earth?"}]
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith(hf_tokenizer.bos_token) and text.count(hf_tokenizer.bos_token) == 1
    positions = [text.index(m["content"]) for m in messages]
    assert positions == sorted(positions)
    assert text.count(hf_tokenizer.eos_token) == 1  # after the one finished assistant turn
    ids = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids[0] == hf_tokenizer.bos_token_id and ids.count(hf_tokenizer.bos_token_id) == 1
    assert hf_tokenizer.decode(ids) == text
    with pytest.raises(jinja2.TemplateError, match="unsupported chat role: narrator"):
        hf_tokenizer.apply_chat_template([{"role": "narrator", "content": "x"}], tokenize=False)


def _mean_nll(model, hf_tokenizer, text: str) -> float:
    ids = hf_tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).loss.item()


def test_prefers_real_verses_over_the_same_words_reversed(model, hf_tokenizer):
    verses = ["And the LORD spake unto Moses, saying, Speak unto the children of Israel.",
              "For God so loved the world, that he gave his only begotten Son."]
    for verse in verses:
        reversed_verse = " ".join(reversed(verse.split()))
        real, scrambled = _mean_nll(model, hf_tokenizer, verse), _mean_nll(model, hf_tokenizer, reversed_verse)
        assert real < scrambled - 1.0, (verse, real, scrambled)


def test_greedy_generation_is_kjv_english(model, hf_tokenizer):
    vocabulary = set((DEFAULT_MODEL_DIR / "corpus_words.txt").read_text().split())
    prompt = "And God said"
    ids = hf_tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=40, do_sample=False)
    text = hf_tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    words = [w.lower() for w in re.findall(r"[A-Za-z']+", text)]
    assert len(words) >= 10, text
    known = sum(w in vocabulary for w in words) / len(words)
    assert known >= 0.6, f"only {known:.0%} of generated words are English (KJV) words: {text!r}"
    assert len(set(words)) >= 5, f"degenerate repetition: {text!r}"


def test_training_script_explains_how_to_install_a_missing_corpus(monkeypatch, tmp_path):
    path = DEFAULT_MODEL_DIR.parents[2] / "scripts" / "train_default_model.py"
    spec = importlib.util.spec_from_file_location("train_default_model", path)
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)  # its dataclasses look their module up there
    spec.loader.exec_module(script)
    monkeypatch.setattr(script, "BIBLE_DATA", tmp_path / "no-bible.data")
    with pytest.raises(SystemExit, match="apt-get install -y bible-kjv-text bible-kjv"):
        script.load_corpus()


def test_training_scripts_mtp_layer_is_the_engines(model):
    """The MTP layer as the training script runs it (transformers' decoder layer, the main model's normed output,
    position 0's embedding zeroed), read back from the shipped checkpoint, gives the engine's draft logits."""
    from latentserve.config import AttentionConfig
    from latentserve.models import load_model
    from latentserve.models.mtp import load_mtp
    from tests.models.paged import PagedRunner
    from tests.models.test_mtp import HELD_OUT

    sys.path.insert(0, str(DEFAULT_MODEL_DIR.parents[2] / "scripts"))
    try:
        from default_model_mtp import load_mtp_layer, main_hidden
    finally:
        sys.path.pop(0)
    ids = Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json")).encode(HELD_OUT).ids[:200]
    script_mtp = load_mtp_layer(model, DEFAULT_MODEL_DIR).eval()
    with torch.no_grad():
        hidden = main_hidden(model, torch.tensor([ids]))
        expected = script_mtp(model, hidden[:, :-1], torch.tensor([ids[1:]]))[0]
    attn_config = AttentionConfig(block_size=16)
    main = load_model(DEFAULT_MODEL_DIR, attn_config=attn_config)
    ours = PagedRunner(load_mtp(DEFAULT_MODEL_DIR, main, attn_config), attn_config).step([(0, ids[1:])],
                                                                                         hidden[0, :-1])
    torch.testing.assert_close(ours.log_softmax(-1), expected.log_softmax(-1), rtol=0, atol=1e-3)
