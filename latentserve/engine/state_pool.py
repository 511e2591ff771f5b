"""The state pool of a hybrid model's linear-attention layers: one slot per running request.

A linear-attention layer (attention/linear/) keeps no per-token rows: each request has one fixed-size state per
layer (the short convolution's last inputs and the delta rule's matrix). The pool holds `max_num_seqs` slots, so the
scheduler's sequence limit bounds it; the block manager hands a request its slot together with its first KV blocks
and takes it back with them (finish, abort, preemption). A slot's state is reset by the layer when its request
starts from token 0, so a request preempted by recompute restarts from a zero state.
"""
from __future__ import annotations

import torch

from latentserve.engine.request import Request


class StatePool:
    """Slot ids of the state tensors; the tensors themselves are allocated by `allocate_state_caches`."""

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"the state pool needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    def allocate(self, request: Request) -> None:
        """Give the request a slot, unless it holds one."""
        if request.state_slot is not None:
            return
        if not self.free_slots:
            raise RuntimeError(f"no free state slot for request {request.request_id!r}: all {self.num_slots} are "
                               "held (the scheduler admits at most max_num_seqs requests)")
        request.state_slot = self.free_slots.pop()

    def free(self, request: Request) -> None:
        if request.state_slot is not None:
            self.free_slots.append(request.state_slot)
            request.state_slot = None


def allocate_state_caches(
    layers: dict[str, torch.nn.Module], num_slots: int, dtype: torch.dtype, device: torch.device | str
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each linear-attention layer's conv state `[slots, ...]` (in `dtype`) and recurrent state (fp32, as the
    recurrence runs), zeroed and bound to the layer."""
    caches = {}
    for name, layer in layers.items():
        conv_shape, recurrent_shape = layer.state_shapes()
        conv = torch.zeros(num_slots, *conv_shape, dtype=dtype, device=device)
        recurrent = torch.zeros(num_slots, *recurrent_shape, dtype=torch.float32, device=device)
        layer.bind_states(conv, recurrent)
        caches[name] = (conv, recurrent)
    return caches
