"""`linear` against F.linear: the transposed product for skinny inputs gives the same numbers."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from latentserve.layers.linear import SKINNY_ROWS, Linear, linear


@pytest.fixture
def two_threads():
    """The transposed orientation is taken only with several threads (tests/conftest.py sets one)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 32, 33, 40])
def test_linear_equals_f_linear(two_threads, rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen)
    weight = torch.randn(80, 96, generator=gen)
    b = torch.randn(80, generator=gen) if bias else None
    out = linear(x, weight, b)
    assert out.shape == (rows, 80) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_transposed_product_is_taken_only_for_skinny_inputs_with_threads(two_threads, monkeypatch) -> None:
    """The orientation switch must fire where intended, or the benchmark's measured win is not the engine's."""
    calls: list[tuple[int, int]] = []
    mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: calls.append(tuple(a.shape)) or mm(a, b))
    weight = torch.randn(16, 8)
    for rows in (1, min(SKINNY_ROWS), max(SKINNY_ROWS), max(SKINNY_ROWS) + 1):
        linear(torch.randn(rows, 8), weight)
    linear(torch.randn(2, 3, 8), weight)  # not 2-D: plain F.linear
    torch.set_num_threads(1)
    linear(torch.randn(4, 8), weight)
    assert calls == [(16, 8), (16, 8)]


def test_linear_module_is_a_drop_in_nn_linear(two_threads) -> None:
    layer = Linear(12, 7)
    x = torch.randn(5, 12)
    torch.testing.assert_close(layer(x), torch.nn.Linear.forward(layer, x))
    assert set(dict(layer.named_parameters())) == {"weight", "bias"}
