"""DeepSeek-R1, DeepSeek-V3.1 and later (`deepseek_v3`), and GLM-4.5 and later (`glm45`): the output is reasoning up
to `</think>`, then the answer. The chat template may already have written `<think>` into the prompt, so the output
need not start with it; without `</think>` everything is reasoning. With thinking off (V3.1's default, GLM's
`enable_thinking: false`) the template writes the `</think>` itself, and the request gets no parser
(`parser_for_prompt`)."""
from __future__ import annotations

from latentserve.engine.detokenizer import TokenizerInfo
from latentserve.engine.reasoning.base import ReasoningParser, held_back, register_reasoning_parser


@register_reasoning_parser("glm45")
@register_reasoning_parser("deepseek_v3")
@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser(ReasoningParser):
    start_token = "<think>"
    end_token = "</think>"

    def __init__(self, tokenizer: TokenizerInfo) -> None:
        super().__init__(tokenizer)
        self.end_token_id = tokenizer.tokenizer.token_to_id(self.end_token)
        if self.end_token_id is None:
            raise ValueError(f"reasoning parser {type(self).__name__}: the tokenizer has no {self.end_token!r} token")

    def extract_reasoning(self, text: str, partial: bool = False) -> tuple[str | None, str | None]:
        if text.startswith(self.start_token):
            text = text[len(self.start_token):]
        elif partial and self.start_token.startswith(text):
            return None, None
        if self.end_token not in text:
            if partial:
                text = text[: len(text) - held_back(text, self.end_token)]
            return text or None, None
        reasoning, _, content = text.partition(self.end_token)
        return reasoning or None, content or None
