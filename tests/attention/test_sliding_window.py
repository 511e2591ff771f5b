"""Sliding-window layers against a naive masked attention: new tokens, context chunks and decodes."""
import pytest
import torch

import latentserve.attention.mla as mla_module
from latentserve.attention.builder import MLAMetadataBuilder
from latentserve.attention.decode.torch_mqa import TorchMQADecodeBackend
from latentserve.attention.kv_cache import allocate_kv_caches
from latentserve.attention.backend import SelectorConfig
from latentserve.attention.prefill.native import NativePrefillBackend
from latentserve.attention.prefill.torch_sdpa import TorchSDPAPrefillBackend
from latentserve.config import AttentionConfig
from latentserve.forward_context import ForwardContext, StaticForwardContext, set_forward_context
from tests.attention.mla_case import Request, make_batch, make_layer, naive_mla
from tests.kernels.builds import needs_the_engines_kernels

BLOCK = 4
# Decodes (one and several new tokens), a fresh prefill longer than the window, prefills over context that spans
# several workspace chunks, some wholly outside the window.
REQUESTS = [Request(5, 1), Request(14, 2), Request(0, 11), Request(13, 4), Request(21, 3)]


def _run(window: int | None, decode_backend: str | None = None, requests=REQUESTS, prefill_backend: str | None = None):
    config = AttentionConfig(block_size=BLOCK, workspace_tokens=10, decode_threshold=2, decode_backend=decode_backend,
                             prefill_backend=prefill_backend)
    static_ctx = StaticForwardContext()
    layer = make_layer(config, static_ctx=static_ctx, sliding_window=window)
    cache = allocate_kv_caches(static_ctx, 32, BLOCK, torch.float32)[layer.layer_name]
    batch = make_batch(requests, cache, BLOCK, seed=7)
    md = MLAMetadataBuilder([layer.layer_name], static_ctx, config).build(batch.common)
    with set_forward_context(ForwardContext({layer.layer_name: md})):
        out = layer(*batch.new_token_inputs())
    return layer, batch, md, out


@pytest.mark.parametrize("backends", [pytest.param(("NATIVE", "TORCH"), marks=needs_the_engines_kernels),
                                      ("TORCH_SDPA", "TORCH"), ("REFERENCE", "REFERENCE")])
@pytest.mark.parametrize("window", [1, 3, 6, 17, 1000])
def test_sliding_window_matches_naive_masked_attention(window, backends):
    layer, batch, md, out = _run(window, decode_backend=backends[1], prefill_backend=backends[0])
    assert md.num_decodes == 2 and md.prefill.chunked_context is not None
    assert len(md.prefill.chunked_context.slots) >= 2
    assert (out - naive_mla(layer, batch)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("window", [1, 4, 9])
def test_one_token_decodes_match_naive_masked_attention(window):
    layer, batch, md, out = _run(window, "TORCH", [Request(5, 1), Request(14, 1), Request(9, 1)])
    assert md.num_decodes == 3 and md.prefill is None
    assert (out - naive_mla(layer, batch)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("window", [1, 3, 5])
def test_chunks_outside_every_window_are_not_read(monkeypatch, window):
    gathered = []
    gather = mla_module.gather_kv_cache
    monkeypatch.setattr(mla_module, "gather_kv_cache", lambda cache, slots, out: gathered.append(slots) or gather(
        cache, slots, out=out))
    layer, batch, md, out = _run(window)
    chunked = md.prefill.chunked_context
    # Contexts 13 and 21 in chunks of 3 (10 workspace rows over 3 prefills): only the last W - 1 positions count.
    assert chunked.chunk_size == 3 and len(chunked.slots) == 7
    # The first queries (positions 13 and 21) see back to 14 - W and 22 - W: W=3 needs chunks 3, 4 (positions
    # 9..14) and 6 (18..20); W=5 also chunk 5 (15..17).
    expected = {1: 0, 3: 3, 5: 4}[window]
    assert len(gathered) == expected
    assert (out - naive_mla(layer, batch)).abs().max().item() <= 1e-5


def test_a_window_changes_the_output():
    windowed = _run(3)[3]
    full_layer, full_batch, _, full = _run(None)
    assert (full - naive_mla(full_layer, full_batch)).abs().max().item() <= 1e-5
    assert (windowed - full).abs().max().item() > 1e-2


def test_windowed_layers_get_backends_that_honour_the_window():
    layer = _run(4)[0]
    prefill = TorchSDPAPrefillBackend if NativePrefillBackend.unavailable_reason() else NativePrefillBackend
    assert isinstance(layer.prefill_backend, prefill) and layer.prefill_backend.sliding_window == 4
    assert isinstance(layer.decode_backend, TorchMQADecodeBackend) and layer.decode_backend.sliding_window == 4


@pytest.mark.parametrize("name", ["PAGED", "NATIVE"])
def test_a_backend_without_windows_is_refused_by_name(name):
    config = AttentionConfig(block_size=BLOCK, decode_backend=name)
    with pytest.raises(ValueError, match=f"{name} cannot be used: .*does not support sliding-window attention"):
        make_layer(config, sliding_window=4)


def test_torch_sdpa_takes_windows_on_the_cpu_only():
    shape = dict(dtype=torch.float32, num_heads=2, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
                 v_head_dim=8)
    assert TorchSDPAPrefillBackend.validate_configuration("cpu", SelectorConfig(**shape, sliding_window=4)) == []
    assert TorchSDPAPrefillBackend.validate_configuration("cuda", SelectorConfig(**shape)) == []
    reasons = TorchSDPAPrefillBackend.validate_configuration("cuda", SelectorConfig(**shape, sliding_window=4))
    assert reasons and "CPU only" in reasons[-1]


@pytest.mark.parametrize("window", [0, -2, 2.5])
def test_a_bad_window_is_refused(window):
    with pytest.raises(ValueError, match="sliding_window must be a positive int"):
        make_layer(AttentionConfig(block_size=BLOCK), sliding_window=window)
