"""Next-token sampling from logits, in vLLM's order.

Raw logprobs; allowed token ids, bad words, min_tokens stop bans, logit bias, penalties; then greedy argmax, or
temperature, min-p, top-k, top-p and a draw from the request's own seeded stream.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from latentserve.engine.argmax import argmax
from latentserve.engine.logits_processors import (
    BadWords,
    LogitBias,
    Penalties,
    apply_min_p,
    build_allowed_mask,
    build_token_mask,
)
from latentserve.engine.request import Logprobs, Request
from latentserve.engine.structured import apply_grammar_bitmask, grammar_bitmask
from latentserve.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    """Per-row sampling settings of one batch, as tensors on the logits' device (None: no row uses it)."""

    # An all-greedy batch takes the argmax alone: None for both then (no per-step tensors to build).
    temperature: torch.Tensor | None  # [B] fp32; 1.0 on greedy rows (they take the argmax instead)
    greedy: torch.Tensor | None  # [B] bool
    top_k: torch.Tensor | None  # [B] int64, vocab size where off
    top_p: torch.Tensor | None  # [B] fp32, 1.0 where off
    min_p: torch.Tensor | None  # [B] fp32, 0.0 where off
    generators: dict[int, torch.Generator]  # row -> the seeded request's own stream
    num_logprobs: list[int | None]  # per row: top-k logprobs wanted (-1: the whole row), None for none
    banned: torch.Tensor | None  # [B, V] bool: stop tokens a row may not sample yet (min_tokens)
    allowed_mask: torch.Tensor | None  # [B, V] bool: True where a row with allowed_token_ids may not sample
    bad_words: BadWords | None
    logit_bias: LogitBias | None
    penalties: Penalties | None
    grammar_bitmask: torch.Tensor | None = None  # [B, ceil(V/32)] int32: the tokens each row's grammar allows

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        vocab_size: int,
        device: torch.device | str = "cpu",
        banned_token_ids: list[list[int]] | None = None,
        prompt_token_ids: list[torch.Tensor | list[int]] | None = None,
        output_token_ids: list[list[int]] | None = None,
        bad_words_token_ids: list[list[list[int]]] | None = None,
    ) -> "SamplingMetadata":
        """Token histories default to empty; bad words are token id sequences (the engine tokenizes them).

        Token ids in `params` are checked against the vocabulary when the request is made, not here (per step).
        """
        if len(params) != len(generators):
            raise ValueError(f"{len(params)} sampling params but {len(generators)} generators")
        empty = [[] for _ in params]
        banned = banned_token_ids or empty
        outputs = output_token_ids or empty
        for row_banned in banned:
            for token_id in row_banned:
                if not 0 <= token_id < vocab_size:
                    raise ValueError(f"stop token id {token_id} is outside the vocabulary (size {vocab_size})")
        greedy = [p.is_greedy for p in params]
        all_greedy = all(greedy)
        top_k = top_p = min_p = None
        if any(p.top_k_enabled for p in params):
            top_k = torch.tensor([min(p.top_k, vocab_size) if p.top_k_enabled else vocab_size for p in params], device=device)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([float(p.top_p) for p in params], dtype=torch.float32, device=device)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([float(p.min_p) for p in params], dtype=torch.float32, device=device)
        return cls(
            temperature=None if all_greedy else torch.tensor(
                [1.0 if g else float(p.temperature) for p, g in zip(params, greedy)], dtype=torch.float32, device=device),
            greedy=None if all_greedy else torch.tensor(greedy, dtype=torch.bool, device=device),
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            generators={i: g for i, (g, gr) in enumerate(zip(generators, greedy)) if g is not None and not gr},
            num_logprobs=[p.logprobs for p in params],
            banned=build_token_mask(banned, vocab_size, device),
            allowed_mask=build_allowed_mask([p.allowed_token_ids for p in params], vocab_size, device),
            bad_words=BadWords.build(bad_words_token_ids or empty, outputs, device),
            logit_bias=LogitBias.build([p.logit_bias for p in params], device),
            penalties=Penalties.build(params, prompt_token_ids or empty, outputs, vocab_size, device),
        )

    @classmethod
    def from_requests(cls, requests: list[Request], vocab_size: int, device: torch.device | str = "cpu") -> "SamplingMetadata":
        """The metadata of the requests that sample this step, one row each in order."""
        metadata = cls.from_params(
            [r.sampling_params for r in requests],
            [r.generator(device) for r in requests],
            vocab_size,
            device,
            [r.banned_token_ids() for r in requests],
            [r.prompt_token_ids_tensor() if r.sampling_params.uses_penalties else [] for r in requests],
            [r.output_token_ids for r in requests],
            [r.bad_words_token_ids for r in requests],
        )
        metadata.grammar_bitmask = grammar_bitmask([r.structured_output for r in requests], vocab_size)
        return metadata

    @property
    def all_greedy(self) -> bool:
        return self.greedy is None

    @property
    def processes_logits(self) -> bool:
        """Whether any logits processor runs before temperature."""
        return any(x is not None for x in (self.grammar_bitmask, self.banned, self.allowed_mask, self.bad_words,
                                           self.logit_bias, self.penalties))


@dataclass
class SamplerOutput:
    sampled_token_ids: list[int]
    logprobs: list[Logprobs | None]  # per row; None where the request did not ask


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep, per row, the logits at least as large as the row's k-th largest (ties kept)."""
    # A full sort rather than topk(max k): reading max k back to the host would sync the device.
    sorted_logits = logits.sort(dim=-1, descending=True).values
    threshold = sorted_logits.gather(-1, (top_k - 1).unsqueeze(-1))
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep, per row, the most likely tokens until their probability reaches top_p (at least one)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # Rows with top_p == 1 keep everything: round-off must not drop their tail.
    drop = (mass_before >= top_p.unsqueeze(-1)) & (top_p < 1.0).unsqueeze(-1)
    drop = torch.zeros_like(drop).scatter(-1, order, drop)
    return logits.masked_fill(drop, float("-inf"))


def _exponential_noise(shape: torch.Size, generators: dict[int, torch.Generator], device: torch.device) -> torch.Tensor:
    """Exp(1) noise as -log(U), U ~ U[0, 1): E is never 0 (U < 1), and U = 0 gives E = inf, a token not chosen. On CPU
    this is ~7x cheaper than `exponential_` (14 -> 2 ms at 32 x 16k, benchmarks/RESULTS.md). A seeded row draws from
    its own generator, so its draw ignores the rest of the batch."""
    noise = torch.rand(shape, dtype=torch.float32, device=device)
    for row, generator in generators.items():
        noise[row] = torch.rand(shape[-1], dtype=torch.float32, device=device, generator=generator)
    return noise.log_().neg_()


def _top_logprobs(logprobs: torch.Tensor, num_logprobs: list[int | None]) -> list[list[tuple[int, float]] | None]:
    """Per row its k likeliest (token id, logprob), likeliest first; k = -1: the whole row. Only the rows that ask
    for -1 pay for a full sort: the others share one top-k of the largest finite k."""
    result: list[list[tuple[int, float]] | None] = [None] * len(num_logprobs)
    finite = [k for k in num_logprobs if k is not None and k != -1]
    if finite:
        top = logprobs.topk(min(max(finite), logprobs.shape[-1]), dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
        for row, k in enumerate(num_logprobs):
            if k is not None and k != -1:
                result[row] = list(zip(top_ids[row][:k], top_values[row][:k]))
    full_rows = [row for row, k in enumerate(num_logprobs) if k == -1]
    if full_rows:
        full = logprobs[full_rows].sort(dim=-1, descending=True)
        for row, ids, values in zip(full_rows, full.indices.tolist(), full.values.tolist()):
            result[row] = list(zip(ids, values))
    return result


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: list[int | None]) -> list[Logprobs | None]:
    """Per row: the given token's logprob and rank over the whole row, and the row's top-k (k = -1: all of it)."""
    if all(k is None for k in num_logprobs):
        return [None] * len(num_logprobs)
    top = _top_logprobs(logprobs, num_logprobs)
    chosen = logprobs.gather(-1, token_ids.unsqueeze(-1))
    # vLLM's rank: how many entries are at least as likely, so a tie with the token counts against it.
    ranks = (logprobs >= chosen).sum(dim=-1).tolist()
    ids, values = token_ids.tolist(), chosen.squeeze(-1).tolist()
    return [None if k is None else Logprobs(ids[row], values[row], ranks[row], top[row])
            for row, k in enumerate(num_logprobs)]


class Sampler:
    """Samples one token per row of fp32 logits [num_reqs, vocab]."""

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        rows = len(metadata.num_logprobs)
        if logits.dim() != 2 or logits.shape[0] != rows:
            raise ValueError(f"logits must be [{rows}, vocab], got {tuple(logits.shape)}")
        raw_logits = logits.float()
        logits = self.process_logits(raw_logits.clone(), metadata) if metadata.processes_logits else raw_logits
        sampled = argmax(logits)
        if not metadata.all_greedy:
            sampled = torch.where(metadata.greedy, sampled, self._sample_random(logits, metadata))
        # Logprobs of the raw logits, before temperature and truncation (vLLM's default).
        logprobs: list[Logprobs | None] = [None] * logits.shape[0]
        if any(k is not None for k in metadata.num_logprobs):
            logprobs = gather_logprobs(raw_logits.log_softmax(dim=-1), sampled, metadata.num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled.tolist(), logprobs=logprobs)

    @staticmethod
    def process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The processors that can change the argmax, in place where they can, in vLLM's order (grammar first)."""
        if metadata.grammar_bitmask is not None:
            apply_grammar_bitmask(logits, metadata.grammar_bitmask)
        if metadata.allowed_mask is not None:
            logits.masked_fill_(metadata.allowed_mask, float("-inf"))
        if metadata.bad_words is not None:
            metadata.bad_words.apply(logits)
        if metadata.banned is not None:
            logits.masked_fill_(metadata.banned, float("-inf"))
        if metadata.logit_bias is not None:
            metadata.logit_bias.apply(logits)
        if metadata.penalties is not None:
            logits = metadata.penalties.apply(logits)
        return logits

    @staticmethod
    def random_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """What a sampled row draws from, given its processed logits: temperature, min-p, top-k, top-p, softmax."""
        logits = logits / metadata.temperature.unsqueeze(-1)
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        if metadata.top_k is not None:
            logits = apply_top_k(logits, metadata.top_k)
        if metadata.top_p is not None:
            logits = apply_top_p(logits, metadata.top_p)
        return logits.softmax(dim=-1)

    @classmethod
    def _sample_random(cls, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        probs = cls.random_probs(logits, metadata)
        # argmax(p / E) with E ~ Exp(1) samples from p (the exponential race), without a device sync.
        noise = _exponential_noise(probs.shape, metadata.generators, probs.device)
        return argmax(probs / noise)


def compute_prompt_logprobs(logits: torch.Tensor, target_token_ids: list[int], num_logprobs: int) -> list[Logprobs]:
    """Logprobs of prompt tokens: row i of `logits` predicts target_token_ids[i] (rows past the targets ignored)."""
    n = len(target_token_ids)
    if n > logits.shape[0]:
        raise ValueError(f"{n} prompt tokens to score but only {logits.shape[0]} rows of logits")
    if n == 0:
        return []
    logprobs = logits[:n].float().log_softmax(dim=-1)
    targets = torch.tensor(target_token_ids, device=logits.device)
    return gather_logprobs(logprobs, targets, [num_logprobs] * n)  # type: ignore[return-value]
