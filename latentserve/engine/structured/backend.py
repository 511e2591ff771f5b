"""The grammar engine: xgrammar, vLLM's default. Its matcher and its bitmask kernel both run on CPU (the bitmask also
on CUDA), it compiles a JSON schema in milliseconds for this vocabulary, and it rolls a matcher back token by token,
which speculative decoding needs. llguidance was not measured here: xgrammar already meets the benchmark's budget."""
from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

from latentserve.structured_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

# xgrammar's C++ errors start with "[time] file.cc:line: " and sometimes "Check failed: (...) is false: ".
_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: .*? is false: )?")


def _clean(error: Exception) -> str:
    return _CPP_PREFIX.sub("", str(error).strip()).strip()


def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-unicode map, which byte-level BPE vocabularies are written in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _token_bytes(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]) -> list[bytes | None]:
    """Each token id's bytes (None past the tokenizer's vocabulary)."""
    size = min(vocab_size, tokenizer.get_vocab_size(with_added_tokens=True))
    if type(tokenizer.decoder).__name__ == "ByteLevel":  # DeepSeek's: decoded here, exactly
        byte_of = _byte_decoder()
        tokens = [tokenizer.id_to_token(i) for i in range(size)]
        return [None if t is None else bytes(byte_of.get(c, 0) for c in t) for t in tokens]
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast  # other tokenizers: xgrammar's detection of the vocab type
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    return list(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=size, stop_token_ids=stop_token_ids).decoded_vocab)


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """The vocabulary as raw bytes per token id; added tokens (control tokens) are never emitted by a grammar."""
    import xgrammar as xgr
    added = set(tokenizer.get_added_tokens_decoder())
    tokens = _token_bytes(tokenizer, vocab_size, stop_token_ids)
    # Empty: xgrammar treats the token as special (as are ids past the tokenizer's vocabulary: padding rows).
    vocab = [b"" if i in added or i >= len(tokens) or tokens[i] is None else tokens[i] for i in range(vocab_size)]
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop_token_ids)


# xgrammar (0.2.9) writes the characters of a string with minLength or maxLength, and of a key under propertyNames,
# as `[^"\\\r\n]`: raw control characters U+0000-U+001F pass, which JSON forbids unescaped (strict parsers refuse
# them). Its JSON grammars use negated classes only for a string's characters, so each is made to exclude them too.
_NEGATED_CLASS = re.compile(r"\[\^((?:\\.|[^\]\\])*)\]")
_CONTROLS = r"\0-\x1f"


def _exclude_controls(match: re.Match) -> str:
    body = match.group(1)
    return match.group(0) if body.startswith(_CONTROLS) else f"[^{_CONTROLS}{body}]"


def _json_grammar(schema: str, compact: bool, strict: bool) -> xgr.Grammar:
    import xgrammar as xgr
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=not compact,
                                           separators=(",", ":") if compact else None, strict_mode=strict)
    return xgr.Grammar.from_ebnf(_NEGATED_CLASS.sub(_exclude_controls, str(grammar)))


def _choice_grammar(choices: list[str]) -> str:
    # EBNF string literals take JSON's escapes.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def build_grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    """The grammar of a spec; a ValueError names what is wrong with the spec."""
    import xgrammar as xgr
    kind = params.kind
    compact = params.disable_any_whitespace
    try:
        if kind == "json":
            schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
            return _json_grammar(schema, compact, strict=True)
        if kind == "json_object":
            # Not strict: any properties are allowed.
            return _json_grammar('{"type": "object"}', compact, strict=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(_choice_grammar(params.choice))
        return xgr.Grammar.from_ebnf(params.grammar)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"structured_outputs.{kind}: {_clean(e)}") from e
