"""The engine's argmax gives torch.argmax's index (first maximum, NaN as the maximum, any vocabulary size): through
latentserve's kernels where they load (fp32 rows), and as chunks where they do not (`chunked`) or for other rows."""
import pytest
import torch

from latentserve.engine import argmax as argmax_module
from latentserve.engine.argmax import CHUNK, argmax


class _NoKernels:
    kernels = None


@pytest.fixture(autouse=True, params=["kernels", "chunked"])
def path(request, monkeypatch):
    if request.param == "chunked":
        monkeypatch.setattr(argmax_module, "default_policy", _NoKernels)
    return request.param


@pytest.mark.parametrize("shape", [(1, 102400), (8, 32000), (3, 96), (2, 1), (5, CHUNK), (4, CHUNK + 1), (0, 300),
                                   (2, 3, 700)])
def test_matches_torch_on_random_rows(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))
    assert torch.equal(argmax(x), x.argmax(-1))


def test_ties_nan_and_infinities_as_torch():
    x = torch.randn(6, 3 * CHUNK + 7, generator=torch.Generator().manual_seed(0))
    x[0, 10] = x[0, 2 * CHUNK + 3] = 50.0  # a tie across chunks: the first
    x[1, CHUNK + 4] = x[1, CHUNK + 9] = 50.0  # a tie inside a chunk: the first
    x[2] = float("-inf")  # nothing sampleable: index 0
    x[3, 300] = x[3, 700] = float("nan")  # NaN wins, the first one
    x[4] = 1.0  # all equal
    x[5, -1] = 99.0  # the maximum in the padded last chunk
    assert argmax(x).tolist() == x.argmax(-1).tolist() == [10, CHUNK + 4, 0, 300, 0, 3 * CHUNK + 6]


def test_bf16_and_non_contiguous_rows():
    x = torch.randn(700, 3, generator=torch.Generator().manual_seed(1)).t()
    assert torch.equal(argmax(x), x.argmax(-1))
    y = x.contiguous().bfloat16()  # coarse values: many ties
    assert torch.equal(argmax(y), y.argmax(-1))


def test_empty_vocabulary_is_refused():
    with pytest.raises(ValueError, match="empty last dimension"):
        argmax(torch.zeros(2, 0))
