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
    # A row's result does not depend on the rows beside it (a verification step equals the decode steps it replaces).
    assert torch.equal(native.dense_linear(kernels(isa), x[-1:].contiguous(), w, torch.float32)[0], got[-1])


def test_dense_linear_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match=r"weight must be a CPU tensor, contiguous float32 or bfloat16 \[\*, 8\]"):
        native.dense_linear(kernels(ISAS[0]), torch.randn(1, 8), torch.randn(8, 4).t())
    with pytest.raises(ValueError, match="float16"):
        native.dense_linear(kernels(ISAS[0]), torch.randn(1, 8), torch.randn(4, 8).half())


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
