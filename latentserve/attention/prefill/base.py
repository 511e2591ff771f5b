"""`MLAPrefillBackend`: attention of prefill tokens over expanded K/V (the MHA path)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from latentserve.attention.backend import BackendCapabilities
from latentserve.attention.metadata import MLAPrefillMetadata


class OwnershipError(RuntimeError):
    """Per-batch state reached a ubatch or builder it does not belong to."""


class MLAPrefillBackend(BackendCapabilities, ABC):
    """Runs the prefill attention of one batch; `prepare_metadata()` stores per-batch state on the instance.

    Because of that state an instance belongs to exactly one metadata builder; builders take a
    `clone()` of the layer's instance. With `config.debug_ownership` a second owner, or running
    with metadata the instance was not prepared for, raises `OwnershipError`.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> "MLAPrefillBackend":
        self = super().__new__(cls)
        # Kept so clone() rebuilds any subclass, whatever extra arguments its constructor takes.
        self._init_args = (args, kwargs)
        return self

    def __init__(
        self,
        num_heads: int,
        scale: float,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        config: Any = None,
        sliding_window: int | None = None,
    ) -> None:
        if sliding_window is not None and not self.supports_sliding_window:
            raise ValueError(f"{self.get_name()} does not support sliding-window attention")
        self.num_heads = num_heads
        self.scale = scale
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.config = config
        self.sliding_window = sliding_window
        self._prefill_metadata: MLAPrefillMetadata | None = None
        self._owner: object | None = None

    def clone(self) -> "MLAPrefillBackend":
        """A fresh instance of the same class and settings, sharing no per-batch state."""
        args, kwargs = self._init_args
        return type(self)(*args, **kwargs)

    def settings_key(self) -> tuple:
        """Equal for instances built with equal settings: their clones are interchangeable."""
        args, kwargs = self._init_args
        return type(self), args, tuple(sorted(kwargs.items()))

    @property
    def debug(self) -> bool:
        return bool(getattr(self.config, "debug_ownership", False))

    def claim(self, owner: object) -> None:
        """Record the builder that owns this instance."""
        if self.debug and self._owner is not None and self._owner is not owner:
            raise OwnershipError(
                f"{type(self).__name__} instance {id(self):#x} is already owned by {self._owner!r}; "
                f"{owner!r} must use its own clone()"
            )
        self._owner = owner

    def prepare_metadata(self, prefill_metadata: MLAPrefillMetadata) -> None:
        self._prefill_metadata = prefill_metadata

    def check_prepared_for(self, prefill_metadata: MLAPrefillMetadata) -> None:
        """Raise if this instance holds state prepared for another batch than the one being run."""
        if self.debug and self._prefill_metadata is not prefill_metadata:
            raise OwnershipError(
                f"{type(self).__name__} instance {id(self):#x} was prepared for another batch than the one "
                "this forward runs: per-batch state is shared across ubatches"
            )

    @property
    def prefill_metadata(self) -> MLAPrefillMetadata:
        if self._prefill_metadata is None:
            raise RuntimeError(f"{type(self).__name__}: prepare_metadata() was not called")
        return self._prefill_metadata

    @abstractmethod
    def run_prefill_new_tokens(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, return_softmax_lse: bool
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Causal attention of each prefill's new tokens over themselves.

        q, k: `[T, N, P+R]`, v: `[T, N, V]` -> out `[T, N, V]` (and lse `[T, N]`).
        """

    @abstractmethod
    def run_prefill_context_chunk(
        self, chunk_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Non-causal attention of each prefill's new tokens over its part of context chunk `chunk_idx`.

        q: `[T, N, P+R]`; k, v: the chunk's up-projected rows -> out `[T, N, V]`, lse `[T, N]`.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={id(self):#x})"
