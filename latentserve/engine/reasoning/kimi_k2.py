"""Kimi K2 Thinking / K2.5: reasoning in <think>...</think> as DeepSeek-R1, but the model may open its tool calls
section without closing the reasoning first; the section then ends the reasoning and goes to the answer, where the
kimi_k2 tool parser finds the calls."""
from __future__ import annotations

from latentserve.engine.reasoning.base import held_back, register_reasoning_parser
from latentserve.engine.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser

SECTION_BEGIN = "<|tool_calls_section_begin|>"


@register_reasoning_parser("kimi_k2")
class KimiK2ReasoningParser(DeepSeekR1ReasoningParser):
    def extract_reasoning(self, text: str, partial: bool = False) -> tuple[str | None, str | None]:
        head, marker, tail = text.partition(SECTION_BEGIN)
        if self.end_token in head or not (marker or partial):
            return super().extract_reasoning(text, partial)
        if marker:
            reasoning, _ = super().extract_reasoning(head)
            return reasoning, marker + tail
        # Still reasoning: also hold back a tail that could become the section's marker.
        reasoning, _ = super().extract_reasoning(text[: len(text) - held_back(text, SECTION_BEGIN)], partial=True)
        return reasoning, None
