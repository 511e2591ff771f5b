"""The reasoning parser interface and its registry by name."""
from __future__ import annotations

from typing import Callable

from latentserve.engine.detokenizer import TokenizerInfo

_PARSERS: dict[str, type["ReasoningParser"]] = {}
_TRAILING_TOKENS = 4  # the prompt's last tokens searched for the end of the reasoning (newlines may follow it)


class ReasoningParser:
    """Splits output text into (reasoning, content); `end_token_id` ends the reasoning, so the engine starts a
    request's structured-output constraint after it."""

    end_token_id: int | None = None

    def __init__(self, tokenizer: TokenizerInfo) -> None:
        self.tokenizer = tokenizer

    def extract_reasoning(self, text: str, partial: bool = False) -> tuple[str | None, str | None]:
        """(reasoning, content) of an output; None for a part that is absent. `partial`: the output may go on, so a
        tail that could still become a marker is held back."""
        raise NotImplementedError

    def extract_reasoning_streaming(self, previous_text: str, text: str,
                                    finished: bool = False) -> tuple[str | None, str | None]:
        """The (reasoning, content) deltas from `previous_text` to `text` (the output so far); None where nothing new."""
        old_reasoning, old_content = self.extract_reasoning(previous_text, partial=True)
        reasoning, content = self.extract_reasoning(text, partial=not finished)
        return _delta(old_reasoning, reasoning), _delta(old_content, content)


def parser_for_prompt(parser: ReasoningParser | None, prompt_token_ids: list[int]) -> ReasoningParser | None:
    """The parser for a request with this prompt: None when the prompt itself closed the reasoning (its last token,
    past any whitespace-only ones, is the parser's end token): the chat template turned thinking off (DeepSeek-V3.1
    writes `</think>`, GLM and Kimi `<think></think>`), so the whole output is the answer, and a structured-output
    constraint applies from its first token."""
    if parser is None or parser.end_token_id is None:
        return parser
    for token_id in reversed(prompt_token_ids[-_TRAILING_TOKENS:]):
        if token_id == parser.end_token_id:
            return None
        if parser.tokenizer.decode([token_id], False).strip():
            return parser
    return parser


def held_back(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    return next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-n:])), 0)


def _delta(old: str | None, new: str | None) -> str | None:
    old, new = old or "", new or ""
    if not new.startswith(old):  # cannot happen for a growing text, but never send a wrong delta
        raise ValueError("reasoning parser: the parsed text did not grow by appending")
    return new[len(old):] or None


def register_reasoning_parser(name: str) -> Callable[[type[ReasoningParser]], type[ReasoningParser]]:
    def register(cls: type[ReasoningParser]) -> type[ReasoningParser]:
        _PARSERS[name] = cls
        return cls
    return register


def make_reasoning_parser(name: str | None, tokenizer: TokenizerInfo | None) -> ReasoningParser | None:
    """The parser `name` for this tokenizer (None for None); a ValueError says why it cannot be made."""
    if name is None:
        return None
    parser = get_reasoning_parser(name)
    if tokenizer is None:
        raise ValueError(f"reasoning parser {name!r} needs a tokenizer: this checkpoint has no tokenizer.json")
    return parser(tokenizer)


def reasoning_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    if name not in _PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; available: {', '.join(sorted(_PARSERS))}")
    return _PARSERS[name]
