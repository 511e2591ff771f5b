"""The stacked experts' per-expert path (a few tokens on a multi-threaded CPU) against the grouped path and a naive
per-token fp32 reference."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from latentserve.layers import stacked_experts
from latentserve.layers.moe import MoE, RoutingConfig

HIDDEN, INTER, EXPERTS, TOP_K = 64, 32, 8, 3


def _stacked_moe(dtype: torch.dtype) -> MoE:
    torch.manual_seed(0)
    moe = MoE(HIDDEN, INTER, RoutingConfig(EXPERTS, TOP_K), n_shared_experts=0)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
    moe = moe.to(dtype)
    moe.stack_experts()
    return moe


def _naive(moe: MoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = moe.experts[ids[t, k]]
            gate, up, down = (p.weight.float() for p in (e.gate_proj, e.up_proj, e.down_proj))
            xt = x[t].float()
            out[t] += weights[t, k] * (down @ (F.silu(gate @ xt) * (up @ xt)))
    return out


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("tokens", [0, 1, 6, 21])  # the per-expert path at every size, its limit raised to it
def test_per_expert_path_matches_grouped_and_naive(
    dtype: torch.dtype, tol: float, tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    moe = _stacked_moe(dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    ids = torch.rand(tokens, EXPERTS, generator=g).argsort(dim=1)[:, :TOP_K]
    ids[:, 0] = 2  # one expert gets every token, some get none
    weights = torch.rand(tokens, TOP_K, generator=g)
    threads = torch.get_num_threads()
    with torch.no_grad():
        grouped = moe.run_experts(x, weights, ids)
        torch.set_num_threads(2)
        try:
            limit = max(tokens * TOP_K, stacked_experts.PER_EXPERT_MAX_PAIRS)
            monkeypatch.setattr(stacked_experts, "PER_EXPERT_MAX_PAIRS", limit)
            assert stacked_experts.per_expert_wins(x, tokens * TOP_K)
            per_expert = moe.run_experts(x, weights, ids)
            monkeypatch.setattr(stacked_experts, "PER_EXPERT_MAX_PAIRS", tokens * TOP_K - 1)
            assert not stacked_experts.per_expert_wins(x, tokens * TOP_K)
        finally:
            torch.set_num_threads(threads)
    expected = _naive(moe, x, weights, ids)
    scale = max(expected.abs().amax().item() if tokens else 0.0, 1.0)
    assert per_expert.dtype == dtype and per_expert.shape == x.shape
    torch.testing.assert_close(per_expert.float(), expected, rtol=tol, atol=tol * scale)
    torch.testing.assert_close(per_expert.float(), grouped.float(), rtol=tol, atol=tol * scale)


def test_one_thread_and_many_pairs_take_the_grouped_call() -> None:
    x = torch.zeros(1, HIDDEN)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert not stacked_experts.per_expert_wins(x, stacked_experts.PER_EXPERT_MAX_PAIRS + 1)
        torch.set_num_threads(1)
        assert not stacked_experts.per_expert_wins(x, 1)
    finally:
        torch.set_num_threads(threads)
