"""Layers of different MLA shapes (heads, ranks, head dims, scale, sliding window) under one metadata builder,
against the naive fp32 reference per layer, with and without DBO."""
import pytest
import torch

from latentserve.attention.builder import MLAMetadataBuilder
from latentserve.attention.kv_cache import allocate_kv_caches
from latentserve.config import AttentionConfig, MLAConfig
from latentserve.forward_context import ForwardContext, StaticForwardContext, set_forward_context
from latentserve.ubatch.dbo import run_forward
from latentserve.ubatch.slicing import split_ubatches
from tests.attention.mla_case import MLA, Request, fill_batch, make_batch, make_layer, naive_mla

BLOCK = 4
# Another shape than MLA in every dimension, and a cache row narrower than MLA's (the shared workspace's width).
OTHER = MLAConfig(num_heads=2, kv_lora_rank=20, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=10)
# (shape, scale, sliding window): the last layer has MLA's shape but a window, so a backend clone of its own.
SHAPES = [(MLA, MLA.qk_head_dim**-0.5, None), (OTHER, 0.3, None), (MLA, MLA.qk_head_dim**-0.5, None),
          (MLA, MLA.qk_head_dim**-0.5, 5)]
# Decodes, a fresh prefill, and prefills over context longer than the workspace (several chunks).
REQUESTS = [Request(5, 1), Request(9, 1), Request(0, 7), Request(13, 6), Request(11, 7)]


def _setup(workspace_tokens: int = 8):
    config = AttentionConfig(block_size=BLOCK, workspace_tokens=workspace_tokens)
    static_ctx = StaticForwardContext()
    layers = [make_layer(config, name=f"layers.{i}", static_ctx=static_ctx, seed=i, mla=mla, scale=scale,
                         sliding_window=window) for i, (mla, scale, window) in enumerate(SHAPES)]
    caches = allocate_kv_caches(static_ctx, 24, BLOCK, torch.float32)
    # One block table for every layer; the latents and queries are each layer's own.
    first = make_batch(REQUESTS, caches[layers[0].layer_name], BLOCK, seed=3, mla=layers[0].mla)
    batches = [first] + [fill_batch(REQUESTS, caches[l.layer_name], first.common.block_table, BLOCK,
                                    torch.Generator().manual_seed(3 + i), mla=l.mla) for i, l in enumerate(layers[1:])]
    return config, static_ctx, layers, caches, batches


def _builders(layers, static_ctx, config, n: int) -> list[MLAMetadataBuilder]:
    return [MLAMetadataBuilder([l.layer_name for l in layers], static_ctx, config, builder_id=i) for i in range(n)]


def _stack(layers):
    def forward(*inputs: torch.Tensor) -> torch.Tensor:
        return torch.cat([layer(*inputs[3 * i : 3 * i + 3]) for i, layer in enumerate(layers)], dim=-1)
    return forward


def test_each_layer_matches_the_naive_reference():
    config, static_ctx, layers, _, batches = _setup()
    builder = _builders(layers, static_ctx, config, 1)[0]
    md = builder.build(batches[0].common)
    assert len(md.prefill.chunked_context.slots) >= 2
    with set_forward_context(ForwardContext({l.layer_name: md for l in layers})):
        for layer, batch in zip(layers, batches):
            out = layer(*batch.new_token_inputs())
            assert out.shape[-1] == layer.mla.num_heads * layer.mla.v_head_dim
            assert (out - naive_mla(layer, batch)).abs().max().item() <= 1e-5, layer.layer_name


def test_layers_of_one_shape_share_a_clone_and_shapes_do_not():
    config, static_ctx, layers, _, _ = _setup()
    b0, b1 = _builders(layers, static_ctx, config, 2)
    a, other, a_again, windowed = (b0.prefill_backends[l.layer_name] for l in layers)
    assert a is a_again and len({id(a), id(other), id(windowed)}) == 3
    assert windowed.sliding_window == 5
    assert other.num_heads == OTHER.num_heads and other.scale == 0.3
    assert not {id(x) for x in b0.prefill_backends.values()} & {id(x) for x in b1.prefill_backends.values()}
    assert not {id(l.prefill_backend) for l in layers} & {id(x) for x in b0.prefill_backends.values()}
    assert b0.workspace.shape == (8, MLA.kv_cache_dim)  # the widest row


def test_dbo_equals_no_dbo_across_shapes():
    config, static_ctx, layers, caches, batches = _setup(workspace_tokens=12)
    common = batches[0].common
    inputs = [x for b in batches for x in b.new_token_inputs()]
    snapshot = {k: v.clone() for k, v in caches.items()}
    builders = _builders(layers, static_ctx, config, 2)
    slices = split_ubatches(common, config.decode_threshold)
    assert slices[0].request_slice.stop > slices[1].request_slice.start  # a prefill straddles the split
    with torch.no_grad():
        ref = run_forward(_stack(layers), inputs, common, builders[:1])
        ref_caches = {k: v.clone() for k, v in caches.items()}
        for k, v in caches.items():
            v.copy_(snapshot[k])
        out = run_forward(_stack(layers), inputs, common, builders, slices)
    expected = torch.cat([naive_mla(l, b) for l, b in zip(layers, batches)], dim=-1)
    assert (ref - expected).abs().max().item() <= 1e-5
    assert (out - ref).abs().max().item() <= 1e-6
    for name in caches:
        assert torch.equal(caches[name].nan_to_num(0.0), ref_caches[name].nan_to_num(0.0)), name


def test_values_wider_than_queries_run_on_a_backend_that_takes_them():
    config = AttentionConfig(block_size=BLOCK, workspace_tokens=8)
    wide = MLAConfig(num_heads=2, kv_lora_rank=20, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=16)
    static_ctx = StaticForwardContext()
    layer = make_layer(config, static_ctx=static_ctx, mla=wide, scale=0.3)
    # TORCH_SDPA widens v to q's head dim, not the reverse; NATIVE takes any V where the kernels run
    from latentserve.attention.prefill.native import NativePrefillBackend

    assert layer.prefill_backend.get_name() == ("NATIVE" if NativePrefillBackend.unavailable_reason() is None
                                                else "REFERENCE")
    cache = allocate_kv_caches(static_ctx, 24, BLOCK, torch.float32)[layer.layer_name]
    batch = make_batch(REQUESTS, cache, BLOCK, seed=4, mla=wide)
    md = MLAMetadataBuilder([layer.layer_name], static_ctx, config).build(batch.common)
    with set_forward_context(ForwardContext({layer.layer_name: md})):
        out = layer(*batch.new_token_inputs())
    assert (out - naive_mla(layer, batch)).abs().max().item() <= 1e-5
    refused = r"TORCH_SDPA cannot be used: .*v_head_dim \(16\) <= the query head dim \(12\)"
    with pytest.raises(ValueError, match=refused):
        make_layer(AttentionConfig(block_size=BLOCK, prefill_backend="TORCH_SDPA"), mla=wide)


def test_a_workspace_narrower_than_a_row_is_refused():
    from latentserve.attention.kv_cache import gather_kv_cache

    cache = torch.zeros(2, BLOCK, MLA.kv_cache_dim)
    with pytest.raises(ValueError, match="cannot hold cache rows"):
        gather_kv_cache(cache, torch.tensor([0, 1]), out=torch.empty(4, OTHER.kv_cache_dim))


def test_layers_caching_in_different_dtypes_are_refused():
    config, static_ctx, layers, _, _ = _setup()
    layers[1].kv_cache_dtype = torch.bfloat16
    with pytest.raises(ValueError, match="different dtypes"):
        _builders(layers, static_ctx, config, 1)
