"""KDA's math (attention/linear/ops.py) against naive fp32 references: the convolution against F.conv1d over the
zero-padded sequence, and both pieces continuing over chunks and batched like one sequence alone."""
import torch
import torch.nn.functional as F

from latentserve.attention.linear.ops import causal_conv, delta_rule

C, K, H, D = 12, 4, 2, 8


def _inputs(b: int, t: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, t, H, D, generator=g) for _ in range(3))
    decay = -torch.rand(b, t, H, D, generator=g)
    beta = torch.rand(b, t, H, generator=g)
    return q, k, v, decay, beta


def test_conv_is_causal_conv1d_with_silu():
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(1, 9, C, generator=g), torch.randn(C, K, generator=g)
    out, state = causal_conv(x, weight, torch.zeros(1, C, K - 1))
    want = F.silu(F.conv1d(x.transpose(1, 2), weight[:, None], padding=K - 1, groups=C)[..., :9]).transpose(1, 2)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(state, x[0, -(K - 1):].t()[None])


def test_conv_over_chunks_equals_whole():
    g = torch.Generator().manual_seed(1)
    x, weight = torch.randn(1, 10, C, generator=g), torch.randn(C, K, generator=g)
    whole, _ = causal_conv(x, weight, torch.zeros(1, C, K - 1))
    head, state = causal_conv(x[:, :2], weight, torch.zeros(1, C, K - 1))  # shorter than the kernel
    tail, _ = causal_conv(x[:, 2:], weight, state)
    torch.testing.assert_close(torch.cat([head, tail], 1), whole, rtol=0, atol=1e-6)


def test_delta_rule_recurrence():
    """One token by hand: decay, correct towards v by beta, read with q (q and k L2-normed, q scaled)."""
    q, k, v, decay, beta = _inputs(1, 1)
    state = torch.randn(1, H, D, D)
    out, new = delta_rule(q, k, v, decay, beta, state)
    qn, kn = F.normalize(q[0, 0], dim=-1) * D**-0.5, F.normalize(k[0, 0], dim=-1)
    s = state[0] * decay[0, 0].exp()[..., None]
    s = s + kn[..., None] * ((v[0, 0] - torch.einsum("hk,hkv->hv", kn, s)) * beta[0, 0][..., None])[:, None]
    torch.testing.assert_close(new[0], s, rtol=0, atol=1e-5)
    torch.testing.assert_close(out[0, 0], torch.einsum("hk,hkv->hv", qn, s), rtol=0, atol=1e-5)


def test_delta_rule_over_chunks_and_batched_equals_each_alone():
    q, k, v, decay, beta = _inputs(3, 7)
    zero = torch.zeros(3, H, D, D)
    batched, states = delta_rule(q, k, v, decay, beta, zero)
    for i in range(3):
        one = [x[i : i + 1] for x in (q, k, v, decay, beta)]
        head, state = delta_rule(*(x[:, :3] for x in one), zero[:1])
        tail, final = delta_rule(*(x[:, 3:] for x in one), state)
        torch.testing.assert_close(torch.cat([head, tail], 1), batched[i : i + 1], rtol=0, atol=1e-6)
        torch.testing.assert_close(final, states[i : i + 1], rtol=0, atol=1e-6)
