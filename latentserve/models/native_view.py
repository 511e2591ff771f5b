"""`NativeView`: what a one-call kernel reads of a module's weights (their addresses), built once and rebuilt whenever
a weight may have moved, checked in a few microseconds per step.

A weight moves in two ways: a module's parameter, buffer or submodule is replaced (torch's registration hooks bump
a global generation, whatever module it was) or a tensor's storage is swapped under it (`.data =`: its address
changes). The view keeps the tensors it read, so neither can leave it reading freed memory."""
from __future__ import annotations

from typing import Callable, Generic, TypeVar

import torch
from torch.nn.modules import module as _module

T = TypeVar("T")

_generation = 0


def _replaced(*_) -> None:
    global _generation
    _generation += 1


for _register in (_module.register_module_parameter_registration_hook,
                  _module.register_module_buffer_registration_hook,
                  _module.register_module_module_registration_hook):
    _register(_replaced)

_address = torch.Tensor.data_ptr


class NativeView(Generic[T]):
    def __init__(self) -> None:
        self._entry: tuple | None = None
        self.builds = 0  # how often it was (re)built: a view rebuilt every step would be slower than none

    def get(self, key: tuple, build: Callable[[], tuple[T | None, list[torch.Tensor]]]) -> T | None:
        """The view for `key` (what else it depends on: dtype, threads, kernels): `build()` returns it (None: no
        view) and every tensor it reads by address."""
        entry = self._entry
        if entry is None or entry[0] != key or entry[1] != _generation or tuple(map(_address, entry[2])) != entry[3]:
            view, tensors = build()
            self._entry = entry = (key, _generation, tensors, tuple(map(_address, tensors)), view)
            self.builds += 1
        return entry[4]
