"""`NativeView`: built once, rebuilt when its key changes or a module's tensor is replaced, its tensors kept alive."""
from __future__ import annotations

import torch
from torch import nn

from latentserve.models.native_view import NativeView


def _view_of(layer: nn.Linear):
    view, seen = NativeView(), []

    def build():
        seen.append(layer.weight.data_ptr())
        return layer.weight.data_ptr(), [layer.weight]
    return view, seen, build


def test_built_once_then_reused():
    layer = nn.Linear(4, 4)
    view, seen, build = _view_of(layer)
    assert [view.get(("a",), build) for _ in range(5)] == [layer.weight.data_ptr()] * 5
    assert view.builds == 1 and len(seen) == 1
    view.get(("b",), build)
    assert view.builds == 2


def test_a_replaced_parameter_rebuilds():
    layer = nn.Linear(4, 4)
    view, _, build = _view_of(layer)
    view.get((), build)
    layer.weight = nn.Parameter(torch.zeros(4, 4))
    assert view.get((), build) == layer.weight.data_ptr() and view.builds == 2


def test_a_replaced_buffer_or_submodule_rebuilds():
    layer = nn.Linear(4, 4)
    view, _, build = _view_of(layer)
    view.get((), build)
    layer.register_buffer("scale", torch.ones(4))
    view.get((), build)
    layer.extra = nn.Identity()
    view.get((), build)
    assert view.builds == 3


def test_the_view_keeps_what_it_reads_alive():
    layer = nn.Linear(4, 4)
    view, _, build = _view_of(layer)
    old = layer.weight
    view.get((), build)
    layer.weight = nn.Parameter(torch.zeros(4, 4))
    assert view._entry[2] == [old]  # until the next get rebuilds it, the old weight's memory stays
    view.get((), build)
    assert view._entry[2][0] is layer.weight


def test_an_in_place_update_keeps_the_view():
    layer = nn.Linear(4, 4)
    view, _, build = _view_of(layer)
    view.get((), build)
    with torch.no_grad():
        layer.weight.copy_(torch.ones(4, 4))  # same address: the kernel reads the new values
    view.get((), build)
    assert view.builds == 1
