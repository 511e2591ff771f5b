import torch

from latentserve.attention.merge import merge_attn_states

INF = float("inf")


def _attend(q, k, v):
    s = q @ k.T
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def test_merge_equals_attention_over_union():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(5, 8, generator=g), torch.randn(12, 8, generator=g), torch.randn(12, 6, generator=g)
    full_out, full_lse = _attend(q, k, v)
    a_out, a_lse = _attend(q, k[:7], v[:7])
    b_out, b_lse = _attend(q, k[7:], v[7:])
    # merge works on [T, N, V] / [T, N]: one head here
    out, lse = merge_attn_states(a_out[:, None], a_lse[:, None], b_out[:, None], b_lse[:, None])
    assert torch.allclose(out[:, 0], full_out, atol=1e-6)
    assert torch.allclose(lse[:, 0], full_lse, atol=1e-6)


def test_merge_edge_cases_never_nan():
    o_a = torch.full((4, 1, 3), 2.0)
    o_b = torch.full((4, 1, 3), 5.0)
    lse_a = torch.tensor([[-INF], [INF], [-INF], [0.0]])
    lse_b = torch.tensor([[-INF], [-INF], [1.0], [INF]])
    out, lse = merge_attn_states(o_a, lse_a, o_b, lse_b)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    # both empty (-inf/-inf and +inf counted as -inf): prefix output, lse -inf
    assert torch.equal(out[0], o_a[0]) and lse[0].item() == -INF
    assert torch.equal(out[1], o_a[1]) and lse[1].item() == -INF
    # only one side has keys: that side wins entirely
    assert torch.equal(out[2], o_b[2]) and lse[2].item() == 1.0
    assert torch.equal(out[3], o_a[3]) and lse[3].item() == 0.0


def test_merge_large_lse_is_stable():
    o_a, o_b = torch.ones(1, 1, 2), torch.zeros(1, 1, 2)
    out, lse = merge_attn_states(o_a, torch.tensor([[1000.0]]), o_b, torch.tensor([[1000.0]]))
    assert torch.allclose(out, torch.full((1, 1, 2), 0.5))
    assert abs(lse.item() - (1000.0 + torch.log(torch.tensor(2.0)).item())) < 1e-3
