"""`NgramProposer`: drafts from each request's own tokens (vLLM's "ngram", llama.cpp's prompt lookup), no model.

Where the last n tokens (n from prompt_lookup_max down to prompt_lookup_min) occurred before in the prompt or the
output, the tokens that followed them there are the drafts: text that repeats its input (code edits, extraction,
summaries quoting their source) drafts itself. The latest longest earlier match is taken. Drafts are one-hot, so
rejection sampling keeps the output's distribution exactly at any temperature (greedy: the same tokens), and a
step without a match drafts nothing and costs nothing more than a plain decode step.
"""
from __future__ import annotations

import torch

from latentserve.attention.metadata import CommonAttentionMetadata
from latentserve.engine.spec_decode.proposal import Proposal


def lookup(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The up to k tokens after the latest earlier occurrence of the longest suffix of `tokens` (min_n to max_n
    tokens long) that occurred before; [] if none does."""
    last, length = len(tokens) - 1, 0
    best_end = -1
    for end in range(last - 1, -1, -1):  # end: the last token of an earlier occurrence
        if tokens[end] != tokens[last]:
            continue
        n = 1
        while n < max_n and end - n >= 0 and tokens[end - n] == tokens[last - n]:
            n += 1
        if n > length:
            length, best_end = n, end
            if n == max_n:
                break
    return tokens[best_end + 1: best_end + 1 + k] if length >= min_n else []


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, proposals: list[Proposal], input_ids: torch.Tensor, positions: torch.Tensor,
                hidden: torch.Tensor, common: CommonAttentionMetadata) -> list[list[int]]:
        """Each request's drafts from its own tokens (the step's tensors are not needed)."""
        return [lookup(p.history(), self.min_n, self.max_n, p.num_drafts) if p.num_drafts else []
                for p in proposals]
