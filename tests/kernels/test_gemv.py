"""kernels/gemv.c (fp32 and bf16 linears for few rows) against a float64 product, for each build this machine runs."""
import pytest
import torch
import torch.nn.functional as F

from latentserve.kernels import native
from tests.kernels.builds import ISAS, kernels, needs_a_build

pytestmark = needs_a_build


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [1, 2, 5, 9])  # 9: more rows than one pass over a weight row takes
@pytest.mark.parametrize("k", [64, 100])  # 100: a tail shorter than a vector
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_linear_is_the_product_with_fp32_sums(isa, rows, k, dtype):
    g = torch.Generator().manual_seed(rows + k)
    x, w = torch.randn(rows, k, generator=g).to(dtype), torch.randn(37, k, generator=g).to(dtype)
    expected = x.double() @ w.double().t()
    got = native.dense_linear(kernels(isa), x, w, torch.float32)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    out = native.dense_linear(kernels(isa), x, w, dtype)
    assert out.dtype == dtype and torch.equal(out, got.to(dtype))
    # A row's result does not depend on the rows beside it (a verification step equals the decode steps it replaces).
    assert torch.equal(native.dense_linear(kernels(isa), x[-1:].contiguous(), w, torch.float32)[0], got[-1])


def test_dense_linear_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match=r"weight must be a CPU tensor, contiguous float32 or bfloat16 \[\*, 8\]"):
        native.dense_linear(kernels(ISAS[0]), torch.randn(1, 8), torch.randn(8, 4).t())
    with pytest.raises(ValueError, match="float16"):
        native.dense_linear(kernels(ISAS[0]), torch.randn(1, 8), torch.randn(4, 8).half())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("k", [64, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_experts_are_each_tokens_weighted_sum_of_gated_mlps(isa, tokens, k, dtype):
    """Each token through 3 of experts 10..14 (a stack whose down projections are stored transposed), in expert
    order, then two I-wide chunks of shared experts of gate 1; up to 8 tokens, as the MoE layer sends."""
    g = torch.Generator().manual_seed(k + tokens)
    inter, first = 24, 10
    w13 = (torch.randn(5, 2 * inter, k, generator=g) * 0.2).to(dtype)
    w2t = (torch.randn(5, inter, k, generator=g) * 0.2).to(dtype)
    shared = tuple((torch.randn(2 * inter, k, generator=g) * 0.2).to(dtype) for _ in range(3))  # gate, up, down_t
    x = (torch.randn(tokens, k, generator=g) * 2).to(dtype)
    ids = torch.tensor([[14, 10, 12], [11, 12, 13], [10, 14, 11]] + [
        (torch.randperm(5, generator=g)[:3] + first).tolist() for _ in range(5)])[:tokens]
    weights = torch.rand(tokens, 3, generator=g)

    def mlp(t, gate, up, down_t):
        a = F.silu(gate.double() @ x[t].double()) * (up.double() @ x[t].double())
        return a @ down_t.double()

    expected = torch.zeros(tokens, k, dtype=torch.float64)
    for t in range(tokens):
        for e, w in zip(ids[t].tolist(), weights[t].tolist()):
            expected[t] += w * mlp(t, w13[e - first, :inter], w13[e - first, inter:], w2t[e - first])
        expected[t] += mlp(t, *shared)
    got = native.stacked_experts(kernels(isa), x, w13, w2t, first, ids, weights, shared)
    assert got.dtype == dtype and got.shape == (tokens, k)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol * expected.abs().max().item())
    # A token's result does not depend on the others in the call, nor on the order of its ids.
    alone = native.stacked_experts(kernels(isa), x[-1:].contiguous(), w13, w2t, first, ids[-1:].flip(1),
                                   weights[-1:].flip(1), shared)
    assert torch.equal(alone[0], got[-1])
    routed = native.stacked_experts(kernels(isa), x, w13, w2t, first, ids, weights)
    torch.testing.assert_close(routed.double(), expected - torch.stack([mlp(t, *shared) for t in range(tokens)]),
                               rtol=tol, atol=tol * expected.abs().max().item())


def test_stacked_experts_refuse_what_they_cannot_read():
    w13, w2t = torch.randn(2, 16, 16), torch.randn(2, 8, 16)
    with pytest.raises(ValueError, match="ids must be a CPU tensor, contiguous int64"):
        native.stacked_experts(kernels(ISAS[0]), torch.randn(1, 16), w13, w2t, 0, torch.zeros(1, 1).int(),
                               torch.ones(1, 1))
    with pytest.raises(ValueError, match="w2t must be a CPU tensor, contiguous bfloat16"):
        native.stacked_experts(kernels(ISAS[0]), torch.randn(1, 16).bfloat16(), w13, w2t, 0,
                               torch.zeros(1, 1).long(), torch.ones(1, 1))
    with pytest.raises(ValueError, match=r"holds experts 4..5, got ids \[\[6\]\]"):  # never read past the stack
        native.stacked_experts(kernels(ISAS[0]), torch.randn(1, 16), w13, w2t, 4, torch.tensor([[6]]),
                               torch.ones(1, 1))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [1, 2, 3])  # 3: a pair of rows, then one
@pytest.mark.parametrize("n", [16, 48, 64, 256])  # tiles of 1, 3 x 1, 4, 8 vectors (AVX2: 2, 6 x 1, 8, 2 x 8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_heads_is_the_per_head_product_with_fp32_sums(isa, rows, n, dtype):
    g = torch.Generator().manual_seed(rows * n)
    heads, k = 3, 40
    x, w = torch.randn(rows, heads, k, generator=g).to(dtype), torch.randn(heads, k, n, generator=g).to(dtype)
    expected = torch.einsum("mhk,hkn->mhn", x.double(), w.double())
    got = native.dense_heads(kernels(isa), x, w, torch.float32)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    out = native.dense_heads(kernels(isa), x, w, dtype)
    assert out.dtype == dtype and torch.equal(out, got.to(dtype))


def test_dense_heads_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match=r"N % 16 == 0"):
        native.dense_heads(kernels(ISAS[0]), torch.randn(1, 2, 8), torch.randn(2, 8, 20))
    with pytest.raises(ValueError, match="float16"):
        native.dense_heads(kernels(ISAS[0]), torch.randn(1, 2, 8), torch.randn(2, 8, 16).half())
