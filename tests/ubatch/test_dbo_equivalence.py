"""The contract: output with DBO equals output without it."""
import random

import pytest
import torch

from latentserve.attention.prefill.base import MLAPrefillBackend, OwnershipError
from latentserve.config import AttentionConfig
from latentserve.forward_context import ForwardContext, set_forward_context
from latentserve.ubatch.dbo import run_forward
from latentserve.ubatch.slicing import split_ubatches
from tests.attention.mla_case import Request, make_batch
from tests.ubatch.stack import HIDDEN, Stack

BLOCK = 4


def _random_requests(rng: random.Random) -> list[Request]:
    decodes = [Request(rng.randint(1, 30), 1) for _ in range(rng.randint(0, 4))]
    prefills = [Request(rng.choice([0, 0, rng.randint(1, 40)]), rng.randint(2, 30)) for _ in range(rng.randint(1, 3))]
    return decodes + prefills


def _prepare(stack: Stack, requests: list[Request], seed: int):
    num_blocks = sum(-(-r.seq_len // BLOCK) for r in requests) + 2
    caches = stack.allocate(num_blocks)
    batch = None
    for cache in caches.values():
        batch = make_batch(requests, cache, BLOCK, seed=seed)  # same block table, per-layer random context
    x = torch.randn(batch.common.num_actual_tokens, HIDDEN, generator=torch.Generator().manual_seed(seed))
    return caches, batch.common, x


def _run_both(stack: Stack, requests, seed: int):
    caches, common, x = _prepare(stack, requests, seed)
    snapshot = {k: v.clone() for k, v in caches.items()}
    builders = stack.builders(2)
    with torch.no_grad():
        ref = run_forward(stack, [x], common, builders[:1])
        ref_caches = {k: v.clone() for k, v in caches.items()}
        for k, v in caches.items():
            v.copy_(snapshot[k])
        slices = split_ubatches(common, stack.attn_config.decode_threshold)
        out = run_forward(stack, [x], common, builders, slices)
    return ref, out, ref_caches, caches, slices, common


def test_dbo_equals_no_dbo_over_random_batches():
    stack = Stack(2, AttentionConfig(block_size=BLOCK, workspace_tokens=24))
    rng = random.Random(0)
    straddled = 0
    for seed in range(60):
        requests = _random_requests(rng)
        ref, out, ref_caches, caches, slices, common = _run_both(stack, requests, seed)
        straddled += slices[0].request_slice.stop > slices[1].request_slice.start
        assert (out - ref).abs().max().item() <= 1e-6, f"seed {seed}: {requests}"
        for name in caches:
            diff = (caches[name].nan_to_num(0.0) - ref_caches[name].nan_to_num(0.0)).abs().max().item()
            assert diff <= 1e-6, f"seed {seed}: cache {name} differs by {diff}"
    assert straddled >= 20  # many batches split through the middle of a prefill


def test_sharing_the_backend_breaks_dbo(monkeypatch):
    """Take clone() out of the builder with the guard off: ubatch 1's plan replaces ubatch 0's; the output changes."""
    requests = [Request(3, 1), Request(0, 7), Request(5, 9), Request(0, 6)]
    stack = Stack(2, AttentionConfig(block_size=BLOCK, workspace_tokens=64, debug_ownership=False))
    ref, out, *_ = _run_both(stack, requests, seed=1)
    assert (out - ref).abs().max().item() <= 1e-6

    monkeypatch.setattr(MLAPrefillBackend, "clone", lambda self: self)
    ref, out, *_ = _run_both(stack, requests, seed=1)
    assert (out - ref).abs().max().item() > 1e-3


def test_sharing_the_backend_is_caught_in_debug_mode(monkeypatch):
    monkeypatch.setattr(MLAPrefillBackend, "clone", lambda self: self)
    stack = Stack(2, AttentionConfig(block_size=BLOCK))
    with pytest.raises(OwnershipError):
        stack.builders(2)


def test_forward_reading_another_ubatchs_metadata_raises():
    stack = Stack(1, AttentionConfig(block_size=BLOCK))
    caches, common, x = _prepare(stack, [Request(0, 4), Request(0, 4)], seed=0)
    builders = stack.builders(2)
    md = builders[1].build(common)
    with set_forward_context(ForwardContext({n: md for n in stack.layer_names}, ubatch_id=0)):
        with pytest.raises(OwnershipError, match="ubatch 0 is reading metadata built for ubatch 1"):
            stack(x)
