"""DBO's second invariant: each ubatch's builder owns its per-batch state; nothing of it is shared.

On CPU the ubatches alternate strictly, so a shared buffer often goes unnoticed; under CUDA streams it is a race.
"""
import pytest
import torch

from latentserve.config import AttentionConfig
from latentserve.ubatch.dbo import run_forward
from latentserve.ubatch.slicing import slice_common_metadata, split_ubatches
from tests.attention.mla_case import Request, make_batch
from tests.ubatch.stack import HIDDEN, Stack, yield_after_context_gather

BLOCK = 4
# Split exactly between the two requests: each ubatch is one prefill over 8 cached tokens (one context chunk).
REQUESTS = [Request(8, 6), Request(8, 6)]


def _tensors(obj) -> dict[str, torch.Tensor]:
    found = {}
    for name, value in vars(obj).items():
        values = value if isinstance(value, (list, tuple)) else [value]
        for k, v in enumerate(values):
            if torch.is_tensor(v):
                found[f"{name}[{k}]" if values is value else name] = v
    return found


def _span(t: torch.Tensor) -> tuple[int, int]:
    extent = sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def shared_per_batch_state(builders, metadata) -> list[str]:
    """What two ubatches' builders (and the metadata they built) share that belongs to one batch."""
    (b0, b1), (m0, m1) = builders, metadata
    p0, p1 = (next(iter(b.prefill_backends.values())) for b in builders)  # the stack's layers share one shape
    shared = [
        what
        for what, x, y in [
            ("prefill backend", p0, p1),
            ("prepared metadata", p0._prefill_metadata, p1._prefill_metadata),
            ("prefill metadata", m0.prefill, m1.prefill),
            ("context plan", m0.prefill.chunked_context, m1.prefill.chunked_context),
        ]
        if x is y
    ]
    # Every tensor a builder, its backend, its metadata or its plan holds, by the memory it spans: two views of
    # one buffer count if they overlap (the ubatches' disjoint views of the step's inputs do not).
    owners = [(b0, b1), (p0, p1), (m0, m1), (m0.prefill, m1.prefill),
              (m0.prefill.chunked_context, m1.prefill.chunked_context)]
    spans1 = [_span(t) for _, o1 in owners for t in _tensors(o1).values() if t.numel()]
    for o0, _ in owners:
        for name, t in _tensors(o0).items():
            start, end = _span(t)
            if t.numel() and any(start < e and s < end for s, e in spans1):
                shared.append(f"{type(o0).__name__}.{name}")
    return shared


def _setup(debug: bool = True):
    stack = Stack(2, AttentionConfig(block_size=BLOCK, workspace_tokens=64, debug_ownership=debug))
    caches = stack.allocate(16)
    batch = None
    for cache in caches.values():
        batch = make_batch(REQUESTS, cache, BLOCK, seed=5)
    x = torch.randn(batch.common.num_actual_tokens, HIDDEN, generator=torch.Generator().manual_seed(5))
    slices = split_ubatches(batch.common, 1)
    assert [s.request_slice for s in slices] == [slice(0, 1), slice(1, 2)]
    return stack, caches, batch.common, x, slices


def test_builders_share_no_per_batch_state():
    stack, _, common, _, slices = _setup()
    builders = stack.builders(2)
    metadata = [b.build(slice_common_metadata(common, s)) for b, s in zip(builders, slices)]
    assert shared_per_batch_state(builders, metadata) == []

    builders[1].workspace = builders[0].workspace  # the mutation this test exists for
    metadata = [b.build(slice_common_metadata(common, s)) for b, s in zip(builders, slices)]
    shared = shared_per_batch_state(builders, metadata)
    assert shared == ["MLAMetadataBuilder.workspace", "ChunkedContextMetadata.workspace"]


@pytest.mark.parametrize("share_workspace", [False, True])
def test_a_shared_workspace_changes_dbo_output(monkeypatch, share_workspace):
    yield_after_context_gather(monkeypatch)
    stack, caches, common, x, slices = _setup()
    snapshot = {k: v.clone() for k, v in caches.items()}
    builders = stack.builders(2)
    if share_workspace:
        builders[1].workspace = builders[0].workspace
    with torch.no_grad():
        ref = run_forward(stack, [x], common, builders[:1])
        for k, v in caches.items():
            v.copy_(snapshot[k])
        out = run_forward(stack, [x], common, builders, slices)
    diff = (out - ref).abs().max().item()
    if share_workspace:
        assert diff > 1e-3  # ubatch 0 attended over ubatch 1's context
    else:
        assert diff <= 1e-6
