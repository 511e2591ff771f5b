"""One model forward over a step's batch, whole or as two overlapped ubatches."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from latentserve.attention.builder import MLAMetadataBuilder
from latentserve.attention.metadata import CommonAttentionMetadata
from latentserve.forward_context import ForwardContext, set_forward_context
from latentserve.ubatch.runner import enter_layer, run_ubatches
from latentserve.ubatch.slicing import UBatchSlice, slice_common_metadata

ForwardFn = Callable[..., torch.Tensor]


def run_forward(
    forward: ForwardFn,
    inputs: Sequence[torch.Tensor],
    common: CommonAttentionMetadata,
    builders: Sequence[MLAMetadataBuilder],
    slices: Sequence[UBatchSlice] | None = None,
) -> torch.Tensor:
    """`forward(*inputs)` where every input is indexed by token; with `slices`, one ubatch per slice.

    Ubatch i is built by `builders[i]` and runs with its own forward context on its own thread.
    """
    if slices is None:
        metadata = builders[0].build(common)
        with set_forward_context(_context(builders[0], metadata, None)):
            return forward(*inputs)
    if len(builders) < len(slices):
        raise ValueError(f"{len(slices)} ubatches need as many metadata builders, got {len(builders)}")
    metadata = [builders[i].build(slice_common_metadata(common, s)) for i, s in enumerate(slices)]

    def task(i: int) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            with set_forward_context(_context(builders[i], metadata[i], i)):
                return forward(*(x[slices[i].token_slice] for x in inputs))

        return run

    check_yields = builders[0].attn_config.debug_ownership
    return torch.cat(run_ubatches([task(i) for i in range(len(slices))], check_yields))


class _LayerMetadata(dict):
    """Attention metadata by layer name; a layer's lookup is where it starts, for the runner's yield check."""

    def __getitem__(self, name: str):
        enter_layer(name)
        return super().__getitem__(name)

    def get(self, name: str, default=None):
        enter_layer(name)
        return super().get(name, default)


def _context(builder: MLAMetadataBuilder, metadata, ubatch_id: int | None) -> ForwardContext:
    layers = {name: metadata for name in (*builder.layer_names, *builder.state_layer_names)}
    return ForwardContext(attn_metadata=layers if ubatch_id is None else _LayerMetadata(layers), ubatch_id=ubatch_id)
