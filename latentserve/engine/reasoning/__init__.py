"""Reasoning parsers: split a reasoning model's output into its reasoning and its answer (`--reasoning-parser`)."""
from latentserve.engine.reasoning.base import (
    ReasoningParser,
    get_reasoning_parser,
    make_reasoning_parser,
    parser_for_prompt,
    reasoning_parser_names,
    register_reasoning_parser,
)
from latentserve.engine.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from latentserve.engine.reasoning.kimi_k2 import KimiK2ReasoningParser

__all__ = ["DeepSeekR1ReasoningParser", "KimiK2ReasoningParser", "ReasoningParser", "get_reasoning_parser",
           "make_reasoning_parser", "parser_for_prompt", "reasoning_parser_names", "register_reasoning_parser"]
