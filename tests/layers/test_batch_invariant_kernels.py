"""Under batch-invariant mode each kernel chosen by row count gives a row the same bits at every row count (against
the row computed alone), where the default mode switches kernels past a few rows."""
import pytest
import torch

from latentserve import batch_invariant
from latentserve.layers.linear import head_products, linear
from latentserve.layers.moe import NATIVE_MAX_TOKENS, RoutingConfig, Router
from latentserve.kernels.policy import default_policy
from latentserve.layers.quant.int8 import NativeInt8Linear, quantize_int8

pytestmark = pytest.mark.skipif(default_policy().kernels is None, reason="latentserve's CPU kernels do not build here")
ROWS = (1, 2, 5, 9, 31, 70)


def _each_row_as_alone(fn, x: torch.Tensor) -> None:
    """fn over the first n rows, for every n in ROWS, equals fn over each row alone, bit for bit."""
    alone = torch.cat([fn(x[i : i + 1]) for i in range(x.shape[0])])
    for n in ROWS:
        assert torch.equal(fn(x[:n]), alone[:n]), f"{n} rows"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_and_head_products(dtype):
    torch.manual_seed(0)
    x, w, bias = torch.randn(70, 96, dtype=dtype), torch.randn(80, 96, dtype=dtype), torch.randn(80, dtype=dtype)
    xh, wh = torch.randn(70, 4, 32, dtype=dtype), torch.randn(4, 32, 64, dtype=dtype)
    policy = default_policy()
    with batch_invariant.enabled_during(True):
        _each_row_as_alone(lambda rows: linear(rows, w, bias, policy.kernels, policy.dense_rows(dtype, 96)), x)
        _each_row_as_alone(lambda rows: head_products(rows, wh, policy.kernels, policy.head_tokens), xh)
        with pytest.raises(RuntimeError, match="batch-invariant mode runs linears on latentserve's CPU kernels"):
            linear(x, w, bias)  # no kernels: no path whose rows are independent of the batch


def test_int8_linear_at_many_rows():
    """One kernel at every row count, each row's sums its own."""
    torch.manual_seed(0)
    q, scale = quantize_int8(torch.randn(80, 128))
    layer = NativeInt8Linear(q, scale, None, default_policy().kernels)
    with batch_invariant.enabled_during(True):
        _each_row_as_alone(layer, torch.randn(70, 128))


def test_routing_past_native_tokens():
    torch.manual_seed(0)
    router = Router(64, RoutingConfig(16, 4, "sigmoid", "noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True))
    torch.nn.init.normal_(router.weight)
    x = torch.randn(4 * NATIVE_MAX_TOKENS, 64)
    with batch_invariant.enabled_during(True):
        _each_row_as_alone(lambda rows: torch.cat([w.float() for w in router(rows)], dim=1), x)


def test_the_mode_is_off_outside_its_block():
    with batch_invariant.enabled_during(True):
        assert batch_invariant.is_enabled()
    assert not batch_invariant.is_enabled()
