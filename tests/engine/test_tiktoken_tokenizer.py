"""Kimi's tokenizer as published (tiktoken.model + tokenizer_config.json, no tokenizer.json): a small BPE file made
here must encode exactly as tiktoken's own Encoding with Kimi's pattern, round trip, keep the special tokens at their
ids, and serve a tiny random kimi_k25 model end to end."""
import base64
import json
from collections import Counter
from dataclasses import replace

import pytest
import tiktoken

from latentserve.engine.detokenizer import load_tokenizer
from latentserve.engine.tiktoken_tokenizer import KIMI_PATTERN

CORPUS = ("The quick brown fox jumps over the lazy dog. It's the fox's den; they'll say we're done.\n"
          "Numbers 12345 and 2026, spaces   and\ttabs.\n\n机器学习很有趣。机器学习 We'd like THAT! HTTPServer")
SPECIAL = {296: "[BOS]", 297: "[EOS]", 298: "<|im_end|>", 299: "<think>"}
TEXTS = [CORPUS, "", "a", "  leading and trailing  ", "UPPER lower MiXeD 'S 'll", "1234567 3.14 -5",
         "emoji 🦊 and é, ü, ñ\r\n", "中文和English混合", "[BOS]hi<|im_end|><think>x[EOS]",
         "tab\t\tnew\n\n\nline", "zzz zzzz"]


def train_ranks(merges: int) -> dict[bytes, int]:
    """Bytes 0..255, then `merges` greedy pair merges over CORPUS (in bytes)."""
    ranks = {bytes([b]): b for b in range(256)}
    words = [[bytes([b]) for b in word.encode()] for word in CORPUS.split(" ")]
    for _ in range(merges):
        pairs = Counter((w[i], w[i + 1]) for w in words for i in range(len(w) - 1))
        (a, b), _ = max(pairs.items(), key=lambda item: (item[1], item[0]))
        ranks.setdefault(a + b, len(ranks))
        words = [merge(w, a, b) for w in words]
    return ranks


def merge(word: list[bytes], a: bytes, b: bytes) -> list[bytes]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == (a, b):
            out.append(a + b)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def write_tokenizer(folder, ranks: dict[bytes, int]) -> None:
    lines = [f"{base64.b64encode(token).decode()} {rank}" for token, rank in ranks.items()]
    (folder / "tiktoken.model").write_text("\n".join(lines) + "\n")
    config = {"bos_token": "[BOS]", "eos_token": "[EOS]", "added_tokens_decoder": {
        str(i): {"content": c, "special": True, "lstrip": False, "rstrip": False} for i, c in SPECIAL.items()},
        "tokenizer_class": "TikTokenTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer",
                                                                               None]}}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    # The published folder carries the tokenizer's Python code; it must never run.
    (folder / "tokenization_kimi.py").write_text("raise SystemExit('the checkpoint code was executed')\n")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi_tokenizer")
    ranks = train_ranks(39)
    ranks[b"zzz"] = 295  # no merge makes it (b"zz" is no token): tiktoken takes a whole piece that is a token
    assert len(ranks) == 296
    write_tokenizer(path, ranks)
    return path, ranks


def test_encodes_as_tiktoken_and_round_trips(folder):
    path, ranks = folder
    reference = tiktoken.Encoding("kimi-test", pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                                  special_tokens={c: i for i, c in SPECIAL.items()})
    info = load_tokenizer(path)
    for text in TEXTS:
        ids = info.tokenizer.encode(text, add_special_tokens=False).ids
        assert ids == reference.encode(text, allowed_special="all"), text
        assert info.tokenizer.decode(ids, skip_special_tokens=False) == text
    assert any(i >= 256 for i in info.tokenizer.encode(CORPUS, add_special_tokens=False).ids)  # merges were used


def test_special_tokens_keep_their_ids(folder):
    path, _ = folder
    info = load_tokenizer(path)
    assert (info.bos_token_id, info.eos_token_id) == (296, 297)
    assert all(info.tokenizer.token_to_id(c) == i for i, c in SPECIAL.items())
    assert info.tokenizer.decode([296, 65, 298], skip_special_tokens=True) == "A"


def test_a_special_id_that_is_a_rank_is_named(tmp_path, folder):
    _, ranks = folder
    write_tokenizer(tmp_path, ranks)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["7"] = {"content": "<bad>", "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"special token ids \[7\] are also ranks"):
        load_tokenizer(tmp_path)


def test_a_tiny_kimi_k25_checkpoint_with_only_tiktoken_model_serves_text(tmp_path, folder):
    from latentserve import SamplingParams
    from tests.models.arch_harness import llm, make_arch_checkpoint
    from tests.models.test_arch_kimi_k25 import TestKimiK25

    _, ranks = folder
    case = replace(TestKimiK25.case, config={**TestKimiK25.case.config, "vocab_size": 300})
    path = make_arch_checkpoint(tmp_path, case)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).unlink(missing_ok=True)
    write_tokenizer(path, ranks)
    engine = llm(path)
    by_text = engine.generate(["The quick fox"], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    ids = load_tokenizer(path).encode("The quick fox")
    by_ids = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    assert by_text.prompt_token_ids == ids and by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_text.outputs[0].text == load_tokenizer(path).tokenizer.decode(by_ids.outputs[0].token_ids)


def test_a_tiktoken_file_of_another_model_is_refused(tmp_path):
    """Only Kimi's split pattern is known: another model's ranks file would tokenize wrongly, so it is refused."""
    write_tokenizer(tmp_path, train_ranks(39))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["tokenization_other.OtherTokenizer", None]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="other than Kimi's"):
        load_tokenizer(tmp_path)
