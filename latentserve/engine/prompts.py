"""The prompts `LLM.generate` takes, in vLLM's forms: text, token ids, `{"prompt": text}` (TextPrompt) or
`{"prompt_token_ids": ids}` (TokensPrompt), one or a list of them."""
from __future__ import annotations

from typing import Sequence, TypedDict


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


Prompt = str | list[int]  # what the engine tokenizes (engine.tokenize)
PromptType = str | list[int] | TextPrompt | TokensPrompt

_KEYS = {"prompt": str, "prompt_token_ids": list}


def parse_prompt(prompt: PromptType) -> Prompt:
    """A TextPrompt's text or a TokensPrompt's ids; a dict with another key is refused, not ignored (latentserve
    has no multi-modal inputs, LoRA or cache salts)."""
    if not isinstance(prompt, dict):
        return prompt
    unknown = sorted(set(prompt) - _KEYS.keys())
    if unknown:
        raise ValueError(f"prompt dict key(s) {unknown} are not supported: a prompt dict is {{'prompt': text}} or "
                         "{'prompt_token_ids': [ids]}")
    if len(prompt) != 1:
        raise ValueError("a prompt dict holds exactly one of 'prompt' (text) and 'prompt_token_ids' (token ids), "
                         f"got {sorted(prompt) or 'neither'}")
    key, value = next(iter(prompt.items()))
    if not isinstance(value, _KEYS[key]):
        raise ValueError(f"prompt dict {key!r} must be a {_KEYS[key].__name__}, got {type(value).__name__}")
    return value


def parse_prompts(prompts: PromptType | Sequence[PromptType]) -> list[Prompt]:
    """One prompt or a list of them, as the engine's prompts."""
    single = isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
    return [parse_prompt(p) for p in ([prompts] if single else prompts)]
