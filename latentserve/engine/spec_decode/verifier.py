"""Verification of one step's drafts: the target's logits at each request's k+1 positions -> the emitted tokens."""
from __future__ import annotations

import torch

from latentserve.engine.argmax import argmax
from latentserve.engine.request import Request
from latentserve.engine.sampler import Sampler, SamplingMetadata
from latentserve.engine.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID, rejection_sample
from latentserve.sampling_params import SamplingParams


def supports_speculation(request: Request) -> bool:
    """Whether verification can serve the request: its target distribution must not depend on the tokens it
    emits within the step (penalties, bad words, min_tokens' banned stop tokens and a grammar's bitmask do), and
    each emitted token would need its own logprobs entry. Other requests decode one token a step, as without speculation."""
    p = request.sampling_params
    return (p.logprobs is None and p.prompt_logprobs is None and not p.uses_penalties
            and not request.bad_words_token_ids and not request.banned_token_ids() and request.structured_output is None)


def target_scores(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """What each row samples from, in the sampler's order: logit bias and allowed tokens, then temperature,
    min-p, top-k, top-p, softmax. When every row is greedy, the processed logits (their argmax is the token)."""
    metadata = SamplingMetadata.from_params(params, [None] * len(params), logits.shape[-1], logits.device)
    logits = logits.float()
    if metadata.processes_logits:
        logits = Sampler.process_logits(logits.clone(), metadata)
    if metadata.all_greedy:
        return logits
    return Sampler.random_probs(logits, metadata)


def verify(logits: torch.Tensor, requests: list[Request], drafts: list[list[int]], k: int) -> list[list[int]]:
    """logits `[sum(len(d) + 1), vocab]`: each request's positions in order -> its emitted tokens (its accepted
    drafts, then one more), for requests that pass `supports_speculation`."""
    row_params = [r.sampling_params for r, d in zip(requests, drafts) for _ in range(len(d) + 1)]
    flat = target_scores(logits, row_params)
    if all(r.sampling_params.is_greedy for r in requests):
        return _argmax_chains(argmax(flat).tolist(), drafts)
    device = logits.device
    batch = len(requests)
    num_drafts = torch.tensor([len(d) for d in drafts], device=device)
    draft_ids = torch.full((batch, k), PLACEHOLDER_TOKEN_ID, dtype=torch.long, device=device)
    probs = torch.ones(batch, k + 1, logits.shape[-1], device=device)  # padding rows: any valid distribution
    start = 0
    for i, d in enumerate(drafts):
        draft_ids[i, : len(d)] = torch.tensor(d, dtype=torch.long)
        probs[i, : len(d) + 1] = flat[start : start + len(d) + 1]
        start += len(d) + 1
    greedy = torch.tensor([r.sampling_params.is_greedy for r in requests], device=device)
    generators = {i: g for i, r in enumerate(requests)
                  if not r.sampling_params.is_greedy and (g := r.generator(device)) is not None}
    out = rejection_sample(draft_ids, num_drafts, None, probs, greedy, generators)
    return [[t for t in row if t != PLACEHOLDER_TOKEN_ID] for row in out.tolist()]


def _argmax_chains(argmax: list[int], drafts: list[list[int]]) -> list[list[int]]:
    """Greedy verification without the batched sampler: each request's drafts up to the first that is not the
    target's argmax, then the argmax there (what `rejection_sample` computes for greedy rows)."""
    out, start = [], 0
    for d in drafts:
        row = argmax[start : start + len(d) + 1]
        n = 0
        while n < len(d) and d[n] == row[n]:
            n += 1
        out.append(d[:n] + [row[n]])
        start += len(d) + 1
    return out
