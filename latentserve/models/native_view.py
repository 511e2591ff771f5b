"""`NativeView`: what a one-call kernel reads of a module's weights (their addresses), built once and rebuilt whenever
a module's parameter, buffer or submodule is replaced anywhere (torch's registration hooks bump a global generation):
one integer compared per step. Comparing every address instead cost 100-170 us per layer of a quantized V2-Lite
model (its 64 experts' 391 tensors, out of cache after each step's weights stream through).

The view keeps the tensors it read, so a replaced one can never leave it reading freed memory. What it does not see,
as a CUDA graph does not, is a storage swapped under a tensor behind the module's back (`tensor.data = other`):
load or replace weights through the modules (or in place: `copy_` keeps the address and the kernel reads the new
values). Callers whose weights are plain attributes, not parameters or buffers, put their addresses in the key."""
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


class NativeView(Generic[T]):
    def __init__(self) -> None:
        self._entry: tuple | None = None
        self.builds = 0  # how often it was (re)built: a view rebuilt every step would be slower than none

    def get(self, key: tuple, build: Callable[[], tuple[T | None, list[torch.Tensor]]]) -> T | None:
        """The view for `key` (what else it depends on: dtype, threads, kernels): `build()` returns it (None: no
        view) and every tensor it reads by address (kept alive with it)."""
        entry = self._entry
        if entry is None or entry[0] != key or entry[1] != _generation:
            view, tensors = build()
            self._entry = entry = (key, _generation, tensors, view)
            self.builds += 1
        return entry[3]
