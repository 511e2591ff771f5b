"""Structured outputs: output constrained to a JSON schema, a regex, a choice list or an EBNF grammar (xgrammar).

xgrammar is imported where a grammar is first built or matched, not with the package: it imports transformers
(0.6 s), which an engine serving no structured request never needs."""
from latentserve.engine.structured.manager import StructuredOutputManager, apply_grammar_bitmask, grammar_bitmask
from latentserve.engine.structured.request import StructuredOutputRequest

__all__ = ["StructuredOutputManager", "StructuredOutputRequest", "apply_grammar_bitmask", "grammar_bitmask"]
