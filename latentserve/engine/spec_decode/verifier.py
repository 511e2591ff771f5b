"""Verification of one step's drafts: the target's logits at each request's k+1 positions -> the emitted tokens."""
from __future__ import annotations

import torch

from latentserve.engine.request import Request
from latentserve.engine.sampler import apply_top_k, apply_top_p
from latentserve.engine.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID, rejection_sample
from latentserve.sampling_params import SamplingParams


def supports_speculation(params: SamplingParams) -> bool:
    """Whether a request's sampling can be verified here; other requests decode one token a step, as without
    speculation (logprobs would need every emitted position's own entry)."""
    return params.logprobs is None and params.prompt_logprobs is None


def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from: softmax after temperature, top-k and top-p (the sampler's order)."""
    vocab = logits.shape[-1]
    temperature = torch.tensor([1.0 if p.is_greedy else float(p.temperature) for p in params], device=logits.device)
    logits = logits.float() / temperature[:, None]
    if any(p.top_k_enabled for p in params):
        top_k = [min(p.top_k, vocab) if p.top_k_enabled else vocab for p in params]
        logits = apply_top_k(logits, torch.tensor(top_k, device=logits.device))
    if any(p.top_p < 1.0 for p in params):
        logits = apply_top_p(logits, torch.tensor([float(p.top_p) for p in params], device=logits.device))
    return logits.softmax(-1)


def verify(logits: torch.Tensor, requests: list[Request], drafts: list[list[int]], k: int) -> list[list[int]]:
    """logits `[sum(len(d) + 1), vocab]`: each request's positions in order -> its emitted tokens (its accepted
    drafts, then one more), for requests whose `sampling_params` pass `supports_speculation`."""
    device = logits.device
    batch = len(requests)
    num_drafts = torch.tensor([len(d) for d in drafts], device=device)
    draft_ids = torch.full((batch, k), PLACEHOLDER_TOKEN_ID, dtype=torch.long, device=device)
    probs = torch.ones(batch, k + 1, logits.shape[-1], device=device)  # padding rows: any valid distribution
    row_params = [r.sampling_params for r, d in zip(requests, drafts) for _ in range(len(d) + 1)]
    # All greedy: the argmax chain needs no distribution.
    flat = logits if all(p.is_greedy for p in row_params) else target_probs(logits, row_params)
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
