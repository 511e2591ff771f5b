"""DBO's first invariant: within every layer each ubatch yields equally often; debug mode checks it."""
import pytest
import torch

from latentserve.config import AttentionConfig
from latentserve.forward_context import dbo_yield
from latentserve.ubatch.dbo import run_forward
from latentserve.ubatch.runner import UBatchError, UnequalYieldsError, enter_layer, run_ubatches
from latentserve.ubatch.slicing import split_ubatches
from tests.attention.mla_case import Request, make_batch
from tests.ubatch.stack import HIDDEN, Stack, yield_after_context_gather

BLOCK = 4


def _layers(yields_per_layer):
    def run():
        for layer, n in enumerate(yields_per_layer):
            enter_layer(f"layer.{layer}")
            for _ in range(n):
                dbo_yield()

    return run


def test_equal_yields_pass():
    assert run_ubatches([_layers([2, 0, 3]), _layers([2, 0, 3])], check_yields=True) == [None, None]


@pytest.mark.parametrize("first,second,layer", [([2, 1, 2], [2, 2, 2], "layer.1"), ([2, 3], [3, 2], "layer.0")])
def test_unequal_yields_in_a_layer_are_named(first, second, layer):
    """Equal totals are not enough: [2, 3] against [3, 2] shifts which layer runs against which."""
    with pytest.raises(UBatchError, match=f"UnequalYieldsError: ubatch . yielded . times in {layer}") as e:
        run_ubatches([_layers(first), _layers(second)], check_yields=True)
    assert isinstance(e.value.__cause__, UnequalYieldsError)


def test_a_layer_entered_twice_in_a_row_is_one_layer():
    """A layer may look its metadata up twice (the one-call decode block, then the modules where it declines)."""
    def twice():
        enter_layer("layer.0")
        enter_layer("layer.0")
        dbo_yield()
        enter_layer("layer.1")

    assert run_ubatches([twice, _layers([1, 0])], check_yields=True) == [None, None]


def test_unequal_totals_without_layers_are_caught():
    message = "ubatch 1 yielded 2 times before the first layer but ubatch 0 yielded 0 times"
    with pytest.raises(UBatchError, match=message):
        run_ubatches([_layers([]), lambda: [dbo_yield() for _ in range(2)] and None], check_yields=True)


def _run_dbo(debug: bool):
    stack = Stack(2, AttentionConfig(block_size=BLOCK, workspace_tokens=64, debug_ownership=debug))
    # Ubatch 0: two fresh prefills; ubatch 1: a prefill over 8 cached tokens (one context chunk to gather).
    requests = [Request(0, 5), Request(0, 5), Request(8, 10)]
    caches = stack.allocate(16)
    batch = None
    for cache in caches.values():
        batch = make_batch(requests, cache, BLOCK, seed=3)
    x = torch.randn(batch.common.num_actual_tokens, HIDDEN, generator=torch.Generator().manual_seed(3))
    slices = split_ubatches(batch.common, 1)
    assert slices[0].request_slice == slice(0, 2)
    with torch.no_grad():
        return run_forward(stack, [x], batch.common, stack.builders(2), slices)


def test_an_extra_yield_in_one_ubatchs_path_is_caught(monkeypatch):
    yield_after_context_gather(monkeypatch)
    with pytest.raises(UBatchError, match="ubatch 1 failed: UnequalYieldsError: ubatch 1 yielded 3 times in layers.0"):
        _run_dbo(debug=True)
    _run_dbo(debug=False)  # unchecked, the same run goes through
