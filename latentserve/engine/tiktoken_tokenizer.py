"""A checkpoint's tiktoken tokenizer (Kimi K2's `tiktoken.model`, no tokenizer.json) as a `tokenizers.Tokenizer`,
without running the checkpoint's tokenizer code: the tiktoken package reads the ranks, the pattern is Kimi's
published one, and the special tokens come from tokenizer_config.json's `added_tokens_decoder`. tiktoken's BPE merges
the adjacent pair whose joined bytes rank lowest; a byte-level BPE whose merges are ordered by the rank of what they
make, that first takes a piece that is a whole token (`ignore_merges`), encodes the same."""
from __future__ import annotations

import hashlib
from pathlib import Path

from tiktoken.load import load_tiktoken_bpe
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

TIKTOKEN_FILE = "tiktoken.model"

# Kimi K2's pre-tokenization pattern, from its published tokenizer (Han runs, cased words, 1-3 digits, punctuation
# runs, whitespace), in the Oniguruma syntax `tokenizers` uses (`&&` intersects character classes).
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])


def _byte_chars() -> dict[int, str]:
    """The byte-level alphabet: each byte as the printable character `tokenizers`' ByteLevel writes it as."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Every split of a token into two tokens, ordered by the token's rank: tiktoken's rule, as merges."""
    found = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = ranks.get(token[:i]), ranks.get(token[i:])
            if left is not None and right is not None:
                found.append((rank, left, right, token[:i], token[i:]))
    return [(a, b) for *_, a, b in sorted(found)]


def load_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    # tiktoken caches a file by its path; the file's own hash makes a stale cached copy be read again.
    return load_tiktoken_bpe(str(path), expected_hash=hashlib.sha256(path.read_bytes()).hexdigest())


def tiktoken_tokenizer(path: Path, added_tokens: dict[int, dict]) -> Tokenizer:
    """The tokenizer of a tiktoken BPE file and its added tokens (tokenizer_config.json's `added_tokens_decoder`: id ->
    {"content": ..., "special": ...})."""
    ranks = load_tiktoken_ranks(path)
    special_tokens = {i: added["content"] for i, added in added_tokens.items()}
    taken = sorted(set(special_tokens) & set(ranks.values()))
    if taken:
        raise ValueError(f"{path}: special token ids {taken[:5]} are also ranks of its BPE tokens")
    chars = _byte_chars()
    spell = lambda token: "".join(chars[b] for b in token)  # noqa: E731
    vocab = {spell(token): rank for token, rank in ranks.items()}
    vocab.update({content: i for i, content in special_tokens.items()})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[(spell(a), spell(b)) for a, b in _merges(ranks)],
                                     ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(KIMI_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_tokens([AddedToken(added["content"], special=bool(added.get("special", True)), normalized=False)
                          for _, added in sorted(added_tokens.items())])
    return tokenizer
