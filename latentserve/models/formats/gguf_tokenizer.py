"""A GGUF file's tokenizer (`tokenizer.ggml.*` metadata) as the `tokenizer.json` and `tokenizer_config.json` the
engine reads: byte-level BPE from the token list and merges, the pre-tokenizer its `tokenizer.ggml.pre` names,
control tokens as special tokens, BOS/EOS and the chat template."""
from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

CONTROL, USER_DEFINED = 3, 4  # gguf.TokenType
# tokenizer.ggml.pre -> the splits before byte-level BPE. "gpt-2": GPT-2's own regex (the ByteLevel pre-tokenizer's);
# "deepseek-v3": DeepSeek-V3 / R1's tokenizer: numbers in runs of up to 3, CJK runs, then words and punctuation.
_DEEPSEEK_V3_SPLITS = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+",
)
PRE_TOKENIZERS = ("gpt-2", "deepseek-v3")


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre == "gpt-2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    splits = [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in _DEEPSEEK_V3_SPLITS]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def unsupported_reason(metadata: dict[str, Any]) -> str | None:
    """Why this GGUF's tokenizer cannot be rebuilt (None: it can)."""
    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        return f"tokenizer.ggml.model is {model!r}; supported: 'gpt2' (byte-level BPE)"
    pre = metadata.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in PRE_TOKENIZERS:
        return f"tokenizer.ggml.pre is {pre!r}; supported: {list(PRE_TOKENIZERS)}"
    if "tokenizer.ggml.merges" not in metadata:
        return "tokenizer.ggml.merges is missing"
    return None


def build_tokenizer(metadata: dict[str, Any]) -> tuple[Tokenizer, dict[str, Any]]:
    """(the tokenizer, its tokenizer_config.json) from GGUF metadata `unsupported_reason` accepts."""
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    types: list[int] = metadata.get("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab, merges, ignore_merges=False))
    tokenizer.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre", "gpt-2"))
    tokenizer.decoder = decoders.ByteLevel()
    # Each is in the vocabulary already, so its id stays; special ones are skipped when decoding.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types) if kind == CONTROL])
    tokenizer.add_tokens([AddedToken(t, normalized=False) for t, kind in zip(tokens, types) if kind == USER_DEFINED])
    config: dict[str, Any] = {"add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False))}
    for key, field in (("bos_token", "tokenizer.ggml.bos_token_id"), ("eos_token", "tokenizer.ggml.eos_token_id")):
        if field in metadata:
            config[key] = tokens[metadata[field]]
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = metadata["tokenizer.chat_template"]
    return tokenizer, config
