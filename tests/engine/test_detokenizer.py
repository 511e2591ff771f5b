import json

import pytest

from latentserve.engine.detokenizer import IncrementalDetokenizer, load_tokenizer

TEXTS = [
    "hello world, the quick brown fox",
    "café crème naïve",
    "日本語のテキスト と 中文 混合",
    "emoji 🙂🚀 and ünïcödé ü",
]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decode(tiny_tokenizer, text):
    prompt = tiny_tokenizer.encode("hello").ids
    ids = tiny_tokenizer.encode(text).ids
    detok = IncrementalDetokenizer(tiny_tokenizer, prompt)
    seen = []
    for token_id in ids:
        assert detok.add_token(token_id) is None
        assert "\ufffd" not in detok.output_text  # a split character is held back, never shown broken
        seen.append(detok.output_text)
    assert detok.output_text == tiny_tokenizer.decode(ids) == text
    assert all(later.startswith(earlier) for earlier, later in zip(seen, seen[1:]))


def test_multibyte_characters_span_tokens(tiny_tokenizer):
    ids = tiny_tokenizer.encode("🙂").ids
    assert len(ids) == 4  # one byte per token: the test would not test splitting otherwise
    detok = IncrementalDetokenizer(tiny_tokenizer, [0])
    texts = []
    for token_id in ids:
        detok.add_token(token_id)
        texts.append(detok.output_text)
    assert texts == ["", "", "", "🙂"]


def test_flush_emits_an_unfinished_character(tiny_tokenizer):
    ids = tiny_tokenizer.encode("ok 🙂").ids[:-1]
    detok = IncrementalDetokenizer(tiny_tokenizer, [0])
    for token_id in ids:
        detok.add_token(token_id)
    assert detok.output_text == "ok "
    detok.flush()
    assert detok.output_text == tiny_tokenizer.decode(ids)


def test_special_tokens_skipped_or_kept(tiny_tokenizer):
    eos = tiny_tokenizer.token_to_id("</s>")
    ids = tiny_tokenizer.encode("hello").ids + [eos]
    for skip, expected in ((True, "hello"), (False, "hello</s>")):
        detok = IncrementalDetokenizer(tiny_tokenizer, [0], skip_special_tokens=skip)
        for token_id in ids:
            detok.add_token(token_id)
        assert detok.output_text == expected == tiny_tokenizer.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize(
    "text, stops, expected_text, expected_stop",
    [
        ("the end. stop here. then go", ["stop here"], "the end. ", "stop here"),
        ("the end. stop here. then go", ["then", "stop"], "the end. ", "stop"),  # earliest wins
        ("café crème naïve", ["è"], "café cr", "è"),  # a stop string inside a split character
        ("hello world", ["zzz"], "hello world", None),
    ],
)
def test_stop_string_truncates(tiny_tokenizer, text, stops, expected_text, expected_stop):
    detok = IncrementalDetokenizer(tiny_tokenizer, [0], stop=stops)
    found = None
    for token_id in tiny_tokenizer.encode(text).ids:
        found = detok.add_token(token_id)
        if found:
            break
    assert found == expected_stop and detok.output_text == expected_text


def test_running_text_holds_back_a_possible_stop_prefix(tiny_tokenizer):
    detok = IncrementalDetokenizer(tiny_tokenizer, [0], stop=["END!"])
    for token_id in tiny_tokenizer.encode("abc EN").ids:
        detok.add_token(token_id)
    assert detok.get_output_text(finished=False) == "abc"
    assert detok.get_output_text(finished=True) == "abc EN"


def test_stop_not_checked_when_told_not_to(tiny_tokenizer):
    detok = IncrementalDetokenizer(tiny_tokenizer, [0], stop=["hello"])
    for token_id in tiny_tokenizer.encode("hello").ids:
        assert detok.add_token(token_id, check_stop=False) is None
    assert detok.output_text == "hello"


def test_load_tokenizer_reads_config(tiny_tokenizer, tmp_path):
    tiny_tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": {"__type": "AddedToken", "content": "<s>"},
        "eos_token": "</s>",
        "add_bos_token": True,
        "chat_template": "{{ messages }}",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    info = load_tokenizer(tmp_path)
    assert info.bos_token_id == tiny_tokenizer.token_to_id("<s>")
    assert info.eos_token_id == tiny_tokenizer.token_to_id("</s>")
    assert info.chat_template == "{{ messages }}"
    assert info.encode("hello") == [info.bos_token_id] + tiny_tokenizer.encode("hello").ids
    assert info.encode("hello", add_special_tokens=False) == tiny_tokenizer.encode("hello").ids
    assert info.decode(info.encode("hello")) == "hello"
    assert info.vocab_size == tiny_tokenizer.get_vocab_size()

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(ValueError, match="eos_token '<nope>' is not in the vocabulary"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    info = load_tokenizer(tmp_path)
    assert info.bos_token_id is None and info.eos_token_id is None and info.chat_template is None


def test_load_tokenizer_without_file(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)


def test_include_stop_str_in_output_keeps_the_stop_string(tiny_tokenizer):
    ids = tiny_tokenizer.encode("hello world, the quick brown fox").ids
    results = {}
    for include in (False, True):
        detok = IncrementalDetokenizer(tiny_tokenizer, [0], stop=["the q", "fox"], include_stop_str_in_output=include)
        stop = next(s for s in (detok.add_token(t) for t in ids) if s is not None)
        results[include] = (stop, detok.output_text)
        # Kept stop strings are never held back while running: nothing shown can be taken back.
        assert detok.get_output_text(False) == (detok.output_text if include else detok.output_text[:-4])
    assert results == {False: ("the q", "hello world, "), True: ("the q", "hello world, the q")}


def _wordpiece_with_specials():
    """A tokenizer whose decoder joins tokens with spaces, specials included (as WordPiece models do)."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "[A]": 3, "[B]": 4}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.add_special_tokens(["[A]", "[B]"])
    return tokenizer


def test_spaces_between_special_tokens():
    tokenizer = _wordpiece_with_specials()
    ids = [1, 3, 4, 3, 2]

    def text(prompt=(1,), **kwargs):
        detok = IncrementalDetokenizer(tokenizer, list(prompt), **kwargs)
        for token_id in ids:
            detok.add_token(token_id)
        return detok.output_text

    assert text(skip_special_tokens=False) == " hello [A] [B] [A] world"
    # vLLM's fast-detokenizer rule: a special token right after another loses the decoder's space.
    assert text(skip_special_tokens=False, spaces_between_special_tokens=False) == " hello [A][B][A] world"
    assert text(spaces_between_special_tokens=False) == text() == " hello world"
    # Only output tokens count: a prompt ending in a special token leaves the first output token's space.
    ids[:] = [3, 4]
    assert text(prompt=[4], skip_special_tokens=False, spaces_between_special_tokens=False) == " [A][B]"


def test_bad_words_tokenized_bare_and_after_a_space(tiny_tokenizer):
    from latentserve.engine.detokenizer import TokenizerInfo, bad_words_token_ids

    info = TokenizerInfo(tiny_tokenizer)
    words = bad_words_token_ids(info, ["fox", " quick brown"])
    bare, spaced = tiny_tokenizer.encode("fox").ids, tiny_tokenizer.encode(" fox").ids
    assert words[0] == bare
    assert (spaced in words) == (spaced[0] != bare[0] and len(spaced) == len(bare))
    assert tiny_tokenizer.encode("quick brown").ids in words
