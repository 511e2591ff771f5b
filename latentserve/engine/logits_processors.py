"""Batched logits processing before sampling: allowed ids, bad words, banned ids, logit bias, penalties, min-p.

Each processor takes per-batch tensors built once per step (`build_*`) and touches every row at once: no
Python loop over requests runs on the device. Semantics follow vLLM's sampler.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

# Pads that never equal a token id: one for a bad word's missing prefix, another for an output shorter than it.
_ANY = -1
_NONE = -2


def _pad(rows: list[list[int]], width: int, value: int, left: bool = False) -> list[list[int]]:
    return [[value] * (width - len(r)) + r if left else r + [value] * (width - len(r)) for r in rows]


def _sparse(rows_of_ids: list[list[int]], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row index, token id) of every entry of a ragged per-row list; None if all rows are empty."""
    rows = [row for row, ids in enumerate(rows_of_ids) for _ in ids]
    if not rows:
        return None
    cols = [t for ids in rows_of_ids for t in ids]
    return torch.tensor(rows, device=device), torch.tensor(cols, device=device)


def build_token_mask(rows_of_ids: list[list[int]], vocab_size: int, device: torch.device | str) -> torch.Tensor | None:
    """[B, V] bool, True at each row's listed ids; None if no row lists any."""
    sparse = _sparse(rows_of_ids, device)
    if sparse is None:
        return None
    mask = torch.zeros(len(rows_of_ids), vocab_size, dtype=torch.bool, device=device)
    mask[sparse] = True
    return mask


def build_allowed_mask(allowed: list[list[int] | None], vocab_size: int, device: torch.device | str) -> torch.Tensor | None:
    """[B, V] bool, True where a row that restricts its tokens may NOT sample; None if no row restricts."""
    if all(a is None for a in allowed):
        return None
    keep = build_token_mask([a or [] for a in allowed], vocab_size, device)
    restricted = torch.tensor([a is not None for a in allowed], device=device)
    return ~keep & restricted.unsqueeze(-1)


@dataclass
class LogitBias:
    rows: torch.Tensor  # [K] int64
    token_ids: torch.Tensor  # [K] int64
    values: torch.Tensor  # [K] fp32

    @classmethod
    def build(cls, biases: list[dict[int, float] | None], device: torch.device | str) -> "LogitBias | None":
        entries = [(row, t, v) for row, bias in enumerate(biases) for t, v in (bias or {}).items()]
        if not entries:
            return None
        rows, token_ids, values = zip(*entries)
        return cls(torch.tensor(rows, device=device), torch.tensor(token_ids, device=device),
                   torch.tensor(values, dtype=torch.float32, device=device))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.index_put_((self.rows, self.token_ids), self.values, accumulate=True)


@dataclass
class BadWords:
    """Each bad word of each row, right-aligned, against the row's last output tokens."""

    rows: torch.Tensor  # [W] the row each word belongs to
    words: torch.Tensor  # [W, L] token ids, left-padded with _ANY
    tails: torch.Tensor  # [B, L-1] each row's last L-1 output tokens, left-padded with _NONE

    @classmethod
    def build(cls, bad_words: list[list[list[int]]], output_token_ids: list[list[int]],
              device: torch.device | str) -> "BadWords | None":
        entries = [(row, word) for row, words in enumerate(bad_words) for word in words]
        if not entries:
            return None
        width = max(len(word) for _, word in entries)
        tails = [out[max(len(out) - (width - 1), 0):] if width > 1 else [] for out in output_token_ids]
        return cls(
            rows=torch.tensor([row for row, _ in entries], device=device),
            words=torch.tensor(_pad([word for _, word in entries], width, _ANY, left=True), device=device),
            tails=torch.tensor(_pad(tails, width - 1, _NONE, left=True), dtype=torch.long, device=device).view(
                len(tails), width - 1),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Ban a word's last token where the output ends with the rest of the word (vLLM: output tokens only)."""
        prefix = self.words[:, :-1]
        matched = ((prefix == _ANY) | (prefix == self.tails[self.rows])).all(dim=-1)
        # Unmatched words index a real token but bias it by 0, keeping the shapes static.
        penalty = torch.where(matched, float("-inf"), 0.0)
        return logits.index_put_((self.rows, self.words[:, -1]), penalty, accumulate=True)


@dataclass
class Penalties:
    """vLLM's penalties: repetition over prompt and output tokens, frequency and presence over output tokens."""

    presence: torch.Tensor  # [B] fp32
    frequency: torch.Tensor  # [B] fp32
    repetition: torch.Tensor  # [B] fp32
    prompt_token_ids: torch.Tensor  # [B, Lp] padded with the vocab size
    output_token_ids: torch.Tensor  # [B, Lo] padded with the vocab size

    @classmethod
    def build(cls, params: list, prompt_token_ids: list[torch.Tensor | list[int]], output_token_ids: list[list[int]],
              vocab_size: int, device: torch.device | str) -> "Penalties | None":
        """Prompts may come as cached CPU tensors (they never change; converting lists each step is slow)."""
        used = [p.uses_penalties for p in params]
        if not any(used):
            return None
        # Rows without penalties contribute no tokens: their counts are never read.
        empty = torch.empty(0, dtype=torch.long)
        prompts = [torch.as_tensor(ids, dtype=torch.long) if u else empty for ids, u in zip(prompt_token_ids, used)]
        outputs = [ids if u else [] for ids, u in zip(output_token_ids, used)]
        width = max(len(r) for r in outputs)
        outputs_tensor = torch.tensor(_pad(outputs, width, vocab_size), dtype=torch.long).view(len(outputs), width)

        def values(name: str) -> torch.Tensor:
            return torch.tensor([float(getattr(p, name)) for p in params], dtype=torch.float32, device=device)

        return cls(values("presence_penalty"), values("frequency_penalty"), values("repetition_penalty"),
                   pad_sequence(prompts, batch_first=True, padding_value=vocab_size).to(device), outputs_tensor.to(device))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        num_rows, vocab_size = logits.shape
        output_counts = _bin_counts(self.output_token_ids, num_rows, vocab_size)
        output_mask = output_counts > 0
        seen = _bin_counts(self.prompt_token_ids, num_rows, vocab_size).gt(0) | output_mask
        repetition = torch.where(seen, self.repetition.unsqueeze(-1), 1.0)
        logits = torch.where(logits > 0, logits / repetition, logits * repetition)
        # One fused update: frequency per occurrence, presence once per token seen in the output.
        return logits.sub_(output_counts.mul_(self.frequency.unsqueeze(-1)).add_(output_mask * self.presence.unsqueeze(-1)))


def _bin_counts(token_ids: torch.Tensor, num_rows: int, vocab_size: int) -> torch.Tensor:
    """[B, V] occurrences of each token per row (the padding id vocab_size falls in a dropped extra column)."""
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.float32, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop, per row, tokens whose probability is below min_p times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(-1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))
