"""kernels/gemv.c (fp32 and bf16 linears for few rows) against a float64 product, for each build this machine runs."""
import pytest
import torch

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


def test_dense_linear_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="contiguous float32 or bfloat16 weight"):
        native.dense_linear(kernels(ISAS[0]), torch.randn(1, 8), torch.randn(8, 4).t())
    with pytest.raises(ValueError, match="float16"):
        native.dense_linear(kernels(ISAS[0]), torch.randn(1, 8), torch.randn(4, 8).half())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("k", [64, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_experts_is_each_tokens_weighted_sum_of_gated_mlps(isa, tokens, k, dtype):
    """Each token through 3 of 5 stacked experts (down projections stored transposed) and a separately stored
    "shared" one of gate 1, in the order given."""
    g = torch.Generator().manual_seed(k + tokens)
    inter = 24
    w13 = (torch.randn(5, 2 * inter, k, generator=g) * 0.2).to(dtype)
    w2t = (torch.randn(5, inter, k, generator=g) * 0.2).to(dtype)
    shared = [(torch.randn(inter, k, generator=g) * 0.2).to(dtype) for _ in range(3)]  # gate, up, down_t
    x = (torch.randn(tokens, k, generator=g) * 2).to(dtype)
    chosen = [[4, 0, 2], [1, 2, 3], [0, 4, 1]][:tokens]
    gates = torch.rand(tokens, 4, generator=g)
    gates[:, 3] = 1.0
    expected = torch.zeros(tokens, k, dtype=torch.float64)
    gate_rows, up_rows, down_rows = [], [], []
    for t in range(tokens):
        mlps = [(w13[e, :inter], w13[e, inter:], w2t[e]) for e in chosen[t]] + [tuple(shared)]
        for (wg, wu, wd), gate in zip(mlps, gates[t].tolist()):
            a = torch.nn.functional.silu(wg.double() @ x[t].double()) * (wu.double() @ x[t].double())
            expected[t] += gate * (a @ wd.double())
            gate_rows.append(wg.data_ptr())
            up_rows.append(wu.data_ptr())
            down_rows.append(wd.data_ptr())
    got = native.dense_experts(kernels(isa), x, inter, gate_rows, up_rows, down_rows, gates.flatten())
    assert got.dtype == dtype and got.shape == (tokens, k)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol * expected.abs().max().item())
    # A token's result does not depend on the others in the call.
    alone = native.dense_experts(kernels(isa), x[-1:].contiguous(), inter, gate_rows[-4:], up_rows[-4:],
                                 down_rows[-4:], gates[-1].contiguous())
    assert torch.equal(alone[0], got[-1])


def test_dense_experts_refuses_mismatched_pairs():
    x, rows = torch.randn(2, 16), [torch.randn(8, 16).data_ptr()] * 3
    with pytest.raises(ValueError, match="multiple of the 2 tokens"):
        native.dense_experts(kernels(ISAS[0]), x, 8, rows, rows, rows, torch.ones(3))


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
