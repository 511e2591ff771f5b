"""vLLM's tokenizer modes: `auto` renders chats with the checkpoint's chat template, `deepseek_v32` with
DeepSeek-V3.2's chat encoding built in here. Tokenizing is the same in every mode. The choice is made once, as the
engine loads its tokenizer: the TokenizerInfo it gets carries the encoding, and every chat is rendered with it."""
from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Callable

from latentserve.engine.chat_renderer import ChatRenderer
from latentserve.engine.deepseek_v32_chat import DeepSeekV32Encoding
from latentserve.engine.detokenizer import TokenizerInfo
from latentserve.models.config import ModelConfig

logger = logging.getLogger(__name__)

_ENCODINGS: dict[str, Callable[[], ChatRenderer]] = {"deepseek_v32": DeepSeekV32Encoding}
TOKENIZER_MODES = ("auto", *_ENCODINGS)
# Model types whose checkpoints ship their chat format as code, with no template: in auto mode such a checkpoint
# (when its tokenizer has no template either) gets the built-in encoding rather than failing every chat.
_DEFAULT_MODE = {"deepseek_v32": "deepseek_v32"}


def check_tokenizer_mode(mode: object) -> None:
    if mode not in TOKENIZER_MODES:
        raise ValueError(f"tokenizer_mode {mode!r} is not supported; use one of: {', '.join(TOKENIZER_MODES)} (the "
                         "tokenizer is always the checkpoint's tokenizer.json, or Kimi's tiktoken.model, through the "
                         "tokenizers library; a mode only chooses how chats are rendered)")


def apply_tokenizer_mode(tokenizer: TokenizerInfo, mode: str, model_dir: Path) -> TokenizerInfo:
    """The tokenizer with the chat encoding `mode` asks for; in auto mode, the default encoding of the model in
    `model_dir` where the tokenizer has no chat template."""
    check_tokenizer_mode(mode)
    if mode != "auto":
        return replace(tokenizer, chat_encoding=_ENCODINGS[mode](), tokenizer_mode=mode)
    if tokenizer.chat_template:
        return tokenizer
    default = _DEFAULT_MODE.get(ModelConfig.from_pretrained(model_dir).model_type)
    if default is None:
        return tokenizer
    logger.info("the tokenizer has no chat template: chats are rendered with the %s chat encoding, the default of "
                "this model type (--tokenizer-mode %s asks for it outright)", default, default)
    return replace(tokenizer, chat_encoding=_ENCODINGS[default]())
