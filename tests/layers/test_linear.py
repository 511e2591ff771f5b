"""`linear` against F.linear: the layouts it picks for skinny inputs give the same numbers."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from latentserve.kernels import native
from latentserve.kernels.cpu import cpu_features
from latentserve.kernels.policy import HEAD_TOKENS, KernelPolicy, default_policy
from latentserve.layers.linear import SKINNY_ROWS, SPLIT_ROWS, Linear, head_products, linear


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` as a layer with this weight runs it under the default policy of this setting and thread count."""
    policy = default_policy()
    return linear(x, weight, bias, policy.kernels, policy.dense_rows(weight.dtype, weight.shape[1]))


@pytest.fixture
def two_threads():
    """The other layouts are taken only with several threads (tests/conftest.py sets one)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


@pytest.mark.parametrize("out_features", [80, 81])  # 81: one row cannot split over two threads
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8, 9, 16, 17, 32, 33, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_equals_f_linear(two_threads, rows: int, bias: bool, out_features: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    weight = torch.randn(out_features, 96, generator=gen).to(dtype)
    b = torch.randn(out_features, generator=gen).to(dtype) if bias else None
    out = _linear(x, weight, b)
    assert out.shape == (rows, out_features) and out.is_contiguous() and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=tol, atol=tol)


def _layouts(monkeypatch, calls: list[str]) -> None:
    for name in ("mm", "bmm"):
        original = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, original=original, name=name: calls.append(name) or original(*a))
    original_linear = F.linear
    monkeypatch.setattr(F, "linear", lambda *a: calls.append("F.linear") or original_linear(*a))
    original_native = native.dense_linear
    monkeypatch.setattr(native, "dense_linear", lambda *a: calls.append("native") or original_native(*a))


@pytest.mark.parametrize("setting", ["0", "1"])
def test_each_layout_is_taken_where_intended(two_threads, monkeypatch, setting) -> None:
    """The switch must fire where the benchmark measured its win, or that win is not the engine's."""
    monkeypatch.setenv(native.NATIVE_ENV, setting)
    if setting == "1" and default_policy().kernels is None:
        pytest.skip("latentserve's kernels do not build here")
    calls: list[str] = []
    _layouts(monkeypatch, calls)
    weight = torch.randn(16, 8)
    fp32 = SKINNY_ROWS[torch.float32]
    for rows in (1, 2, max(SPLIT_ROWS), max(SPLIT_ROWS) + 1, max(fp32), max(fp32) + 1):
        _linear(torch.randn(rows, 8), weight)
    _linear(torch.randn(1, 8), torch.randn(15, 8))  # 15 rows of W do not split in two
    _linear(torch.randn(2, 3, 8), weight)  # not 2-D
    for rows in (1, 16, 17, 33):  # bf16: oneDNN keeps its threads busy up to 16 rows
        _linear(torch.randn(rows, 8, dtype=torch.bfloat16), weight.bfloat16())
    torch.set_num_threads(1)
    _linear(torch.randn(1, 8), weight)
    _linear(torch.randn(4, 8), weight)
    if setting == "0":
        assert calls == ["bmm", "mm", "bmm", "mm", "mm", "F.linear", "F.linear", "F.linear",
                         "F.linear", "F.linear", "mm", "F.linear", "F.linear", "F.linear"]
    else:  # latentserve's kernel at 1-3 fp32 rows; bf16 over short rows at 1-4, over long ones at 1-2 (1 on one thread)
        assert calls == ["native", "native", "bmm", "mm", "mm", "F.linear", "native", "F.linear",
                         "native", "F.linear", "mm", "F.linear", "native", "F.linear"]
        # Over long bf16 rows the build with vdpbf16ps keeps 3 rows on either thread count.
        dot = default_policy().kernels.bf16_dot
        calls.clear()
        wide = torch.randn(16, 1024, dtype=torch.bfloat16)
        _linear(torch.randn(3, 8), weight)
        _linear(torch.randn(1, 1024, dtype=torch.bfloat16), wide)
        _linear(torch.randn(2, 1024, dtype=torch.bfloat16), wide)
        _linear(torch.randn(4, 8, dtype=torch.bfloat16), weight.bfloat16())
        _linear(torch.randn(5, 8, dtype=torch.bfloat16), weight.bfloat16())
        assert calls == ["native", "native", "native" if dot else "F.linear", "native", "F.linear"]
        calls.clear()
        torch.set_num_threads(2)
        _linear(torch.randn(3, 8), weight)
        _linear(torch.randn(4, 8), weight)
        _linear(torch.randn(2, 1024, dtype=torch.bfloat16), wide)
        _linear(torch.randn(3, 1024, dtype=torch.bfloat16), wide)
        _linear(torch.randn(4, 1024, dtype=torch.bfloat16), wide)
        assert calls == ["native", "bmm", "native", "native" if dot else "F.linear", "F.linear"]


def test_dense_rows_by_build() -> None:
    """Wide bf16 inputs stay on the kernel up to 3 rows with the vdpbf16ps build, 2 (1 on one thread) without,
    whichever build this machine runs; no kernels, no rows."""
    dot, plain = native.NativeKernels("avx512_bf16", None), native.NativeKernels("avx512_vnni", None)
    assert dot.bf16_dot and not plain.bf16_dot and not native.NativeKernels("avx2", None).bf16_dot
    features = cpu_features()
    for threads in (1, 2):
        with_dot, without = (KernelPolicy(features, kernels, "test", threads) for kernels in (dot, plain))
        assert with_dot.dense_rows(torch.bfloat16, 2048) == 3
        assert without.dense_rows(torch.bfloat16, 2048) == threads
        assert with_dot.dense_rows(torch.bfloat16, 512) == without.dense_rows(torch.bfloat16, 512) == 4
        assert with_dot.dense_rows(torch.float32, 2048) == without.dense_rows(torch.float32, 2048) == 3
        assert with_dot.dense_rows(torch.float16, 2048) == 0
        none = KernelPolicy(features, None, "test", threads)
        assert none.dense_rows(torch.float32, 2048) == none.head_tokens == 0


def test_a_linear_asks_its_policy_once(monkeypatch) -> None:
    """The layer keeps what its policy said when its weights were loaded: a later setting changes nothing."""
    policy = default_policy()
    if policy.kernels is None:
        pytest.skip("latentserve's kernels do not build here")
    calls: list[str] = []
    _layouts(monkeypatch, calls)
    layer = Linear(8, 16, bias=False)
    layer.process_weights_after_loading(policy)
    assert (layer.kernels, layer.native_rows) == (policy.kernels, 3)
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    layer(torch.randn(3, 8))
    layer(torch.randn(4, 8))
    assert calls == ["native", "F.linear"]
    unloaded = Linear(8, 16, bias=False)  # built outside a loader: the default policy of its first call (none here)
    unloaded(torch.randn(1, 8))
    assert unloaded.native_rows == 0 and calls[-1] == "F.linear"


def test_linear_module_is_a_drop_in_nn_linear(two_threads) -> None:
    layer = Linear(12, 8)
    for rows in (1, 5):
        x = torch.randn(rows, 12)
        torch.testing.assert_close(layer(x), torch.nn.Linear.forward(layer, x))
    assert set(dict(layer.named_parameters())) == {"weight", "bias"}


@pytest.mark.parametrize("setting", ["0", "1"])
@pytest.mark.parametrize("tokens", [1, 3, HEAD_TOKENS, HEAD_TOKENS + 1])
@pytest.mark.parametrize("n", [32, 40])  # 40: no native kernel for outputs that are not whole vectors
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_products_equal_bmm_and_use_the_kernel_for_few_tokens(monkeypatch, setting, tokens, n, dtype) -> None:
    monkeypatch.setenv(native.NATIVE_ENV, setting)
    calls: list[str] = []
    original = native.dense_heads
    monkeypatch.setattr(native, "dense_heads", lambda *a: calls.append("native") or original(*a))
    gen = torch.Generator().manual_seed(tokens * n)
    qkv = torch.randn(tokens, 4, 24 + 8, generator=gen).to(dtype)[..., :24]  # a split view, as MLA passes it
    w = torch.randn(4, 24, n, generator=gen).to(dtype)
    policy = default_policy()
    out = head_products(qkv, w, policy.kernels, policy.head_tokens)
    expected = torch.einsum("thk,hkn->thn", qkv.double(), w.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)
    native_expected = setting == "1" and policy.kernels is not None and tokens <= HEAD_TOKENS and n == 32
    assert calls == (["native"] if native_expected else [])
