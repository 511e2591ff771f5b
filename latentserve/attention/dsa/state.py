"""`TopKState`: the top-k selection of one forward of one ubatch, owned by one metadata builder."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from latentserve.attention.prefill.base import OwnershipError

if TYPE_CHECKING:
    from latentserve.attention.dsa.metadata import DSAMetadata


class TopKState:
    """Written by a layer that runs an indexer, read by it and by the later layers that share its selection.

    It is per-batch state read during the forward, so by the ownership rule it belongs to one builder: a state
    reached from two builders (say, kept on the layer, which every ubatch shares) would let ubatch 1's indexer
    overwrite the selection ubatch 0 is about to read. With `debug` a second owner, or a store or load for
    another batch than the one the state was reset for, raises `OwnershipError`.
    """

    def __init__(self, debug: bool) -> None:
        self.debug = debug
        self._owner: object | None = None
        self._batch: DSAMetadata | None = None
        self._slots: torch.Tensor | None = None
        self._writer: str | None = None

    def claim(self, owner: object) -> None:
        if self.debug and self._owner is not None and self._owner is not owner:
            raise OwnershipError(f"TopKState {id(self):#x} is already owned by {self._owner!r}; {owner!r} must "
                                 "build its own")
        self._owner = owner

    def reset(self, batch: DSAMetadata) -> None:
        """Start a forward of `batch`: no layer has selected yet."""
        self._batch, self._slots, self._writer = batch, None, None

    def store(self, batch: DSAMetadata, slots: torch.Tensor, layer_name: str) -> None:
        self._check(batch, layer_name)
        self._slots, self._writer = slots, layer_name

    def load(self, batch: DSAMetadata, layer_name: str) -> torch.Tensor:
        """The cache slots `[T, topk]` (-1: none) the latest indexer layer selected for this forward."""
        self._check(batch, layer_name)
        if self._slots is None:
            raise RuntimeError(f"{layer_name} shares the top-k of an earlier layer, but no layer before it ran an "
                               "indexer in this forward")
        return self._slots

    def _check(self, batch: DSAMetadata, layer_name: str) -> None:
        if self.debug and batch is not self._batch:
            raise OwnershipError(f"{layer_name}: the top-k state {id(self):#x} was reset for another batch than the "
                                 "one this forward runs: top-k state is shared across ubatches")

    def __repr__(self) -> str:
        return f"TopKState(id={id(self):#x}, writer={self._writer!r})"
