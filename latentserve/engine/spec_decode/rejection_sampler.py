"""Rejection sampling of draft tokens against the target model (Leviathan et al., Chen et al. 2023).

Draft token d_j, drawn from the draft distribution q_j, is accepted with probability min(1, p_j(d_j) / q_j(d_j));
at the first rejection the token is drawn from the recovered distribution norm(max(p_j - q_j, 0)) and the rest is
dropped; when every draft is accepted a bonus token is drawn from the target's next distribution. Each emitted
token is then distributed exactly as the target's p, whatever q was. Greedy rows accept a draft iff it is the
target's argmax, and emit the target's argmax where they stop: the exact argmax chain.

`p` are the target's probabilities after the request's own processing (temperature, top-k, top-p); `q` the
draft's, as the draft tokens were drawn from them. A draft that took its argmax has a one-hot q: pass
`draft_probs=None`.
"""
from __future__ import annotations

import torch

PLACEHOLDER_TOKEN_ID = -1  # output slots after a request's last emitted token


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    greedy: torch.Tensor,
    generators: dict[int, torch.Generator] | None = None,
) -> torch.Tensor:
    """Batched verification of up to k drafts per request.

    draft_token_ids `[B, k]` (padding past each row's count is ignored), num_draft_tokens `[B]` (0..k),
    draft_probs `[B, k, V]` or None (one-hot drafts), target_probs `[B, k+1, V]` (row j: the target's distribution
    for the token after draft j-1; rows past num_draft_tokens+1 are ignored), greedy `[B]` bool, generators: row ->
    that request's own random stream. Returns `[B, k+1]` token ids: the accepted drafts, then one recovered or
    bonus token, then `PLACEHOLDER_TOKEN_ID`.
    """
    batch, k = draft_token_ids.shape
    _check_shapes(draft_token_ids, num_draft_tokens, draft_probs, target_probs, greedy)
    device = target_probs.device
    drafts = draft_token_ids.long().clamp(min=0)  # padding may hold placeholders; those slots are ignored
    positions = torch.arange(k, device=device)
    exists = positions[None, :] < num_draft_tokens[:, None]
    target_argmax = target_probs.argmax(-1)
    rows = torch.arange(batch, device=device)
    if bool(greedy.all()):  # the argmax chain alone: target_probs may be any scores (logits)
        accepted = (drafts == target_argmax[:, :k]) & exists
        num_accepted = accepted.int().cumprod(dim=1).sum(dim=1)
        last = target_argmax[rows, num_accepted]
    else:
        num_accepted, last = _verify_sampled(drafts, exists, num_draft_tokens, draft_probs, target_probs, greedy,
                                             target_argmax, generators)
    out = torch.where(positions[None, :] < num_accepted[:, None], drafts, PLACEHOLDER_TOKEN_ID)
    out = torch.cat([out, torch.full((batch, 1), PLACEHOLDER_TOKEN_ID, dtype=out.dtype, device=device)], dim=1)
    out[rows, num_accepted] = last
    return out


def _verify_sampled(drafts, exists, num_draft_tokens, draft_probs, target_probs, greedy, target_argmax, generators):
    """-> (accepted drafts per row, the token each row emits after them)."""
    batch, k = drafts.shape
    device = target_probs.device
    p_draft = target_probs[:, :k].gather(-1, drafts[..., None])[..., 0]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(-1, drafts[..., None])[..., 0]
    uniform = _uniform((batch, k), generators, device)
    accepted = uniform * q_draft < p_draft  # u < p/q, without dividing; a draft the target rules out never passes
    accepted = torch.where(greedy[:, None], drafts == target_argmax[:, :k], accepted) & exists
    num_accepted = accepted.int().cumprod(dim=1).sum(dim=1)

    # Where a row stops: the recovered distribution at its first rejection, or the target's (bonus) after its last
    # draft. A one-hot q turns max(p - q, 0) into p without the rejected token.
    rows = torch.arange(batch, device=device)
    stop_p = target_probs[rows, num_accepted]
    rejected = num_accepted < num_draft_tokens
    stop_q = torch.zeros_like(stop_p)  # only read on rejected rows, which stopped at a draft (so k > 0)
    if k:
        at = num_accepted.clamp(max=k - 1)
        if draft_probs is None:
            stop_q[rows, drafts[rows, at]] = 1.0
        else:
            stop_q = draft_probs[rows, at]
    recovered = (stop_p - stop_q).clamp(min=0)
    final = torch.where(rejected[:, None], recovered, stop_p)
    # p == q exactly makes the recovered mass zero; such a draft is always accepted, so this only guards round-off.
    final = torch.where(final.sum(-1, keepdim=True) > 0, final, stop_p)
    return num_accepted, torch.where(greedy, target_argmax[rows, num_accepted], _sample(final, generators))


def _check_shapes(draft_token_ids, num_draft_tokens, draft_probs, target_probs, greedy) -> None:
    batch, k = draft_token_ids.shape
    if target_probs.dim() != 3 or target_probs.shape[:2] != (batch, k + 1):
        raise ValueError(f"target_probs must be [batch={batch}, k+1={k + 1}, vocab], got {tuple(target_probs.shape)}")
    if draft_probs is not None and draft_probs.shape != (batch, k, target_probs.shape[-1]):
        raise ValueError(
            f"draft_probs must be [{batch}, {k}, {target_probs.shape[-1]}], got {tuple(draft_probs.shape)}"
        )
    if num_draft_tokens.shape != (batch,) or greedy.shape != (batch,):
        raise ValueError(f"num_draft_tokens and greedy must be [batch={batch}], got "
                         f"{tuple(num_draft_tokens.shape)} and {tuple(greedy.shape)}")
    if bool(((num_draft_tokens < 0) | (num_draft_tokens > k)).any()):
        raise ValueError(f"num_draft_tokens must be in [0, {k}], got {num_draft_tokens.tolist()}")


def _uniform(shape: tuple[int, int], generators: dict[int, torch.Generator] | None, device) -> torch.Tensor:
    u = torch.rand(shape, device=device)
    for row, gen in (generators or {}).items():
        u[row] = torch.rand(shape[1], device=device, generator=gen)
    return u


def _sample(probs: torch.Tensor, generators: dict[int, torch.Generator] | None) -> torch.Tensor:
    """One token per row from unnormalized probabilities (rows with a generator draw from it)."""
    out = torch.multinomial(probs, 1)[:, 0]
    for row, gen in (generators or {}).items():
        out[row] = torch.multinomial(probs[row], 1, generator=gen)[0]
    return out
