"""kernels/argmax.c against torch.argmax, for each build this machine runs: the first maximum, a NaN as the
maximum, rows shorter than a vector and with a tail; what its wrapper and entry point refuse."""
import pytest
import torch

from latentserve.kernels import native
from tests.kernels.builds import ISAS, kernels, needs_a_build

pytestmark = needs_a_build


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 17), (9, 16 * 5 + 3), (1, 102400), (12, 4099), (0, 5)])
def test_matches_torch_on_random_rows(isa, shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))
    assert torch.equal(native.argmax(kernels(isa), x), x.argmax(-1))


@pytest.mark.parametrize("isa", ISAS)
def test_ties_nan_and_infinities_as_torch(isa):
    x = torch.randn(9, 211, generator=torch.Generator().manual_seed(0))
    x[0, 10] = x[0, 150] = 50.0  # a tie in two vectors: the first
    x[1, 33] = x[1, 35] = 50.0  # a tie inside a vector: the first
    x[2] = float("-inf")  # nothing sampleable: index 0
    x[3, 100] = x[3, 20] = float("nan")  # NaN wins, the first one
    x[4] = 1.0  # all equal
    x[5, -1] = 99.0  # the maximum in the tail past the last vector
    x[6, -2] = float("nan")  # a NaN in the tail
    x[7, 5] = float("inf")
    x[8] = -0.0
    x[8, 3] = 0.0  # -0 and +0 compare equal: the first
    want = [10, 33, 0, 20, 0, 210, 209, 5, 0]
    assert native.argmax(kernels(isa), x).tolist() == x.argmax(-1).tolist() == want


def test_the_wrapper_and_entry_point_check_what_they_read():
    k = kernels(ISAS[0])
    with pytest.raises(ValueError, match=r"argmax: x must be .*float32.*got cpu bfloat16"):
        native.argmax(k, torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"argmax: x must be .*\[\*, \*\]; got cpu float32 \[8\]"):
        native.argmax(k, torch.zeros(8))
    with pytest.raises(ValueError, match=r"argmax: x must have values in each row, got \[2, 0\]"):
        native.argmax(k, torch.zeros(2, 0))
    d = native.desc
    assert k.lib.ls_argmax(d(torch.zeros(2, 0)), d(torch.empty(2, dtype=torch.int64)), 1) == native.abi.BAD_TENSOR
    assert k.lib.ls_argmax(d(torch.zeros(2, 4)), d(torch.empty(3, dtype=torch.int64)), 1) == native.abi.BAD_TENSOR
    assert k.lib.ls_argmax(d(torch.zeros(2, 4)), d(torch.empty(2, dtype=torch.int32)), 1) == native.abi.BAD_TENSOR
