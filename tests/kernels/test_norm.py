"""kernels/norm.c against torch's RMSNorm, for each build this machine runs, and the layer's use of it."""
import pytest
import torch
import torch.nn.functional as F

from latentserve.kernels import native
from latentserve.kernels.policy import default_policy
from latentserve.layers.norm import RMSNorm
from tests.kernels.builds import ISAS, kernels, needs_a_build

pytestmark = needs_a_build


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [1, 3, 40])  # 40: rows shared out among threads
@pytest.mark.parametrize("n", [64, 100])  # 100: a tail shorter than a vector
def test_rms_norm_matches_torch(isa, rows, n):
    g = torch.Generator().manual_seed(n + rows)
    x, w = torch.randn(2, rows, n, generator=g) * 3, torch.randn(n, generator=g)
    got = native.rms_norm(kernels(isa), x, w, 1e-6)
    torch.testing.assert_close(got, F.rms_norm(x, (n,), w, 1e-6), rtol=1e-5, atol=1e-6)
    # bf16: the normalized row rounds to bf16 before the weight multiplies it (DeepSeek's reference order)
    xb, wb = x.bfloat16(), w.bfloat16()
    expected = wb * F.rms_norm(xb.float(), (n,), eps=1e-6).bfloat16()
    got = native.rms_norm(kernels(isa), xb, wb, 1e-6)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    torch.testing.assert_close(got.float(), expected.float(), rtol=1e-2, atol=1e-2)
    assert (got != expected).float().mean().item() < 0.05  # equal but for a rare last-bit rounding


@pytest.mark.parametrize("isa", ISAS)
def test_bf16_outputs_round_as_torch_rounds(isa):
    """Rows of 39 +-3 and 65 +-1 (104 values: vectors and, on AVX-512, a tail): mean square 4, so the normalized row
    is x / 2 exactly and each bf16 output is the one rounding of (x / 2) * w, which must be torch's to the bit:
    nearest even (1.5 * 129/128 and 1.5 * 131/128 are ties, one rounding up, one down), NaNs quiet, overflow inf."""
    g = torch.Generator().manual_seed(0)
    n = 104
    threes = torch.cat([torch.arange(4), 4 + torch.randperm(n - 4, generator=g)[:35]])
    magnitudes = torch.ones(3, n)
    magnitudes[:, threes] = 3.0
    x = (magnitudes * (torch.randint(0, 2, (3, n), generator=g) * 2 - 1)).bfloat16()
    w = torch.randn(n, generator=g) * torch.logspace(-30, 30, n)
    w[:4] = torch.tensor([129 / 128, 131 / 128, -129 / 128 * 2**10, 131 / 128 * 2**-20])
    w[[5, 17, 98, 99]] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.38e38])
    w = w.bfloat16()
    got = native.rms_norm(kernels(isa), x, w, 0.0)
    expected = (x.float() / 2 * w.float()).bfloat16()
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got.nan_to_num(), expected.nan_to_num())


def test_the_layer_runs_it_in_one_call(monkeypatch):
    if default_policy().kernels is None:
        pytest.skip("latentserve's kernels do not build here")
    calls = []
    monkeypatch.setattr(native, "rms_norm", lambda *a, _f=native.rms_norm: calls.append(1) or _f(*a))
    norm = RMSNorm(32)
    x = torch.randn(2, 32)
    torch.testing.assert_close(norm(x), F.rms_norm(x, (32,), norm.weight, 1e-6))
    assert calls == [1]
    with pytest.raises(ValueError, match="weight must be a CPU tensor, contiguous float32 "):
        native.rms_norm(default_policy().kernels, x, norm.weight.half(), 1e-6)
