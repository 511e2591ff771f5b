"""Tokenizer loading and incremental detokenization with stop strings."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from latentserve.engine.chat_renderer import ChatRenderer
from latentserve.engine.tiktoken_tokenizer import TIKTOKEN_FILE, tiktoken_tokenizer

# Tokens of the prompt's tail decoded with the first output tokens, so that the
# output text starts the way it would in a full decode (e.g. a leading space).
_PROMPT_CONTEXT_TOKENS = 5
CHAT_TEMPLATE_FILE = "chat_template.jinja"


def _token_content(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass
class TokenizerInfo:
    """A checkpoint's tokenizer and what its config says about special tokens."""

    tokenizer: Tokenizer
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    add_bos_token: bool = False
    chat_template: str | None = None
    # A built-in chat encoding that renders chats in the template's place (tokenizer_mode.py chooses it), and the
    # tokenizer mode asked for ("auto": none, whatever the checkpoint then defaulted to).
    chat_encoding: ChatRenderer | None = None
    tokenizer_mode: str = "auto"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        # tokenizer.json alone may not add the BOS that tokenizer_config.json asks for.
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)


def bad_words_token_ids(tokenizer: TokenizerInfo, bad_words: list[str]) -> list[list[int]]:
    """Each bad word as token ids, at the start of the text and (if that tokenizes differently) after a space."""
    result: list[list[int]] = []
    for word in bad_words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        result.append(bare)
        # As vLLM: the spaced form counts when the space makes a different first token of a same-length word.
        if spaced[0] != bare[0] and len(spaced) == len(bare):
            result.append(spaced)
    return result


def has_tokenizer(model_dir: str | Path) -> bool:
    return any((Path(model_dir) / name).is_file() for name in ("tokenizer.json", TIKTOKEN_FILE))


def load_tokenizer(model_dir: str | Path) -> TokenizerInfo:
    """Load `tokenizer.json`, else a tiktoken `tiktoken.model` (Kimi's), and `tokenizer_config.json` if present from a
    checkpoint folder, offline; the checkpoint's own tokenizer code is never run."""
    model_dir = Path(model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    path = model_dir / "tokenizer.json"
    if path.is_file():
        tokenizer = Tokenizer.from_file(str(path))
    elif (model_dir / TIKTOKEN_FILE).is_file():
        path = model_dir / TIKTOKEN_FILE
        if "tokenization_kimi" not in json.dumps(config.get("auto_map", {})):
            # The ranks file does not carry its split pattern: only Kimi's is known here, and another model's text
            # split with it would tokenize wrongly without a word.
            raise ValueError(f"{path}: a tiktoken tokenizer other than Kimi's (tokenizer_config.json's auto_map does "
                             "not name tokenization_kimi); its split pattern is unknown: supply a tokenizer.json")
        added = {int(i): entry for i, entry in config.get("added_tokens_decoder", {}).items()}
        tokenizer = tiktoken_tokenizer(path, added)
    else:
        raise ValueError(f"no tokenizer.json or {TIKTOKEN_FILE} in {model_dir}: latentserve needs a fast (tokenizers) "
                         "tokenizer file or a tiktoken BPE file")

    def token_id(key: str) -> int | None:
        content = _token_content(config.get(key))
        if content is None:
            return None
        found = tokenizer.token_to_id(content)
        if found is None:
            raise ValueError(f"{config_path}: {key} {content!r} is not in the vocabulary of {path}")
        return found

    template = config.get("chat_template")
    if (model_dir / CHAT_TEMPLATE_FILE).is_file():  # as transformers saves it now (GLM's and Kimi's checkpoints)
        template = (model_dir / CHAT_TEMPLATE_FILE).read_text()
    if isinstance(template, list):  # named templates: use the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return TokenizerInfo(
        tokenizer=tokenizer,
        bos_token_id=token_id("bos_token"),
        eos_token_id=token_id("eos_token"),
        add_bos_token=bool(config.get("add_bos_token", False)),
        chat_template=template if isinstance(template, str) else None,
    )


class IncrementalDetokenizer:
    """Turns one request's output tokens into text as they arrive, and finds its stop strings.

    Text is emitted only once it decodes to whole characters: a UTF-8 character
    split across tokens shows up when its last byte arrives, never as U+FFFD.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop or [])
        self.include_stop_str_in_output = include_stop_str_in_output
        # As vLLM's fast detokenizer: without spaces, a special token right after another is its bare content.
        self.added_tokens: dict[int, str] = {}
        if not spaces_between_special_tokens and not skip_special_tokens:
            self.added_tokens = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        self.last_special = False  # whether the last output token was an added one (the prompt's do not count)
        self.output_text = ""
        self.token_ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        # token_ids[prefix_offset:read_offset] decodes to text already emitted (or prompt context).
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's own text, special tokens included: a logprob's decoded_token (vLLM's)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append one token's text; return the stop string it completed (the text is cut before it), if any."""
        self.token_ids.append(token_id)
        after_special, self.last_special = self.last_special, token_id in self.added_tokens
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.token_ids[self.prefix_offset :])
        if len(text) <= len(prefix_text) or text.endswith("\ufffd"):
            return None  # nothing new yet, or an incomplete character
        new_text = text[len(prefix_text) :]
        if after_special and self.last_special:
            new_text = self.added_tokens[token_id]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.output_text += new_text
        return self._find_stop(len(new_text)) if check_stop else None

    def _find_stop(self, num_new_chars: int) -> str | None:
        """Earliest stop string ending in the new text; truncates output_text at its start (or end, if kept)."""
        best: tuple[int, str] | None = None
        for stop in self.stop:
            start = max(len(self.output_text) - num_new_chars - len(stop) + 1, 0)
            index = self.output_text.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        end = best[0] + len(best[1]) if self.include_stop_str_in_output else best[0]
        self.output_text = self.output_text[:end]
        return best[1]

    def flush(self) -> None:
        """At the end of a request, emit what is left even if it is not a whole character."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.token_ids[self.prefix_offset :])
        if len(text) > len(prefix_text):
            self.output_text += text[len(prefix_text) :]
        self.prefix_offset = self.read_offset = len(self.token_ids)

    def get_output_text(self, finished: bool) -> str:
        """Text safe to show now: while running, hold back a tail that could start a stop string."""
        if finished or not self.stop or self.include_stop_str_in_output:
            return self.output_text
        hold = max(len(s) for s in self.stop) - 1
        return self.output_text[: len(self.output_text) - hold] if hold else self.output_text
