"""Structured outputs: output constrained to a JSON schema, a regex, a choice list or an EBNF grammar (xgrammar)."""
from latentserve.engine.structured.manager import StructuredOutputManager, apply_grammar_bitmask, grammar_bitmask
from latentserve.engine.structured.request import StructuredOutputRequest

__all__ = ["StructuredOutputManager", "StructuredOutputRequest", "apply_grammar_bitmask", "grammar_bitmask"]
