"""Static forward context (layer name -> layer) and the per-thread forward context."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator


@dataclass
class ForwardContext:
    """What the layers read during one forward: metadata per layer name, and which ubatch runs."""

    attn_metadata: dict[str, Any] = field(default_factory=dict)
    ubatch_id: int | None = None


class StaticForwardContext(dict):
    """Layer name -> attention layer, filled once when a model is built."""

    def register(self, name: str, layer: Any) -> None:
        if name in self:
            raise ValueError(f"duplicate attention layer name {name!r} in the static forward context")
        self[name] = layer


_local = threading.local()


@contextmanager
def set_forward_context(context: ForwardContext) -> Iterator[ForwardContext]:
    """Install `context` for the current thread (each ubatch thread has its own)."""
    previous = getattr(_local, "context", None)
    _local.context = context
    try:
        yield context
    finally:
        _local.context = previous


def get_forward_context() -> ForwardContext:
    context = getattr(_local, "context", None)
    if context is None:
        raise RuntimeError("no forward context is set: run the model inside set_forward_context()")
    return context


def in_dbo() -> bool:
    """Whether this thread runs a DBO ubatch (its yield hook installed)."""
    return getattr(_local, "yield_hook", None) is not None


def set_dbo_yield_hook(hook: Callable[[], None] | None) -> None:
    """Installed by the ubatch runner on each ubatch thread; None outside DBO."""
    _local.yield_hook = hook


def dbo_yield() -> None:
    """Hand control to the other ubatch and wait for it to hand back; a no-op outside DBO.

    Call it where a ubatch would wait on communication, so the other ubatch computes meanwhile. Every ubatch
    must call it equally often in each layer, whatever its batch holds (`latentserve.ubatch.runner` checks).
    """
    hook = getattr(_local, "yield_hook", None)
    if hook is not None:
        hook()
