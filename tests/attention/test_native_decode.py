"""NATIVE decode (one C call per layer over the paged cache) against the naive fp32 reference and REFERENCE, for
each build of the kernels this machine runs."""
import dataclasses

import pytest
import torch

from latentserve.attention.decode.native import NativeMQADecodeBackend
from latentserve.attention.decode.paged import PagedMQADecodeBackend
from latentserve.attention.decode.reference import ReferenceDecodeBackend
from latentserve.attention.decode.selector import get_mla_decode_backend
from latentserve.attention.metadata import MLADecodeMetadata
from latentserve.config import AttentionConfig, MLAConfig
from latentserve.kernels import native
from tests.attention.mla_case import MLA, SCALE, Request, naive_mla, run_layer, setup
from tests.attention.test_paged_decode import make_batch_with_layout
from tests.kernels.builds import ISAS, kernels, needs_a_build, needs_the_engines_kernels

pytestmark = needs_a_build


def _native_layer(config: AttentionConfig, num_blocks: int, isa: str, kv_cache_dtype=torch.float32):
    layer, builder, cache = setup(config, num_blocks, kv_cache_dtype=kv_cache_dtype)
    assert isinstance(layer.decode_backend, NativeMQADecodeBackend)
    layer.decode_backend.kernels = kernels(isa)
    return layer, builder, cache


@needs_the_engines_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", ["contiguous", "fragmented", "mixed"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("query_len", [1, 3])
def test_native_matches_naive_fp32(isa, kind, block_size, query_len):
    """Through the layer (absorbed products around it), NaN in every slot no request owns."""
    requests = [Request(c, query_len) for c in (5, 70, 200, 1, 131)]
    config = AttentionConfig(block_size=block_size, decode_threshold=query_len, decode_backend="NATIVE")
    num_blocks = 2 * sum(-(-r.seq_len // block_size) for r in requests) + 4
    layer, builder, cache = _native_layer(config, num_blocks, isa)
    batch = make_batch_with_layout(requests, cache, block_size, kind, seed=block_size + query_len)
    assert builder.build(batch.common).num_decodes == len(requests)
    out = run_layer(layer, builder, batch)
    assert not torch.isnan(out).any()
    assert (out - naive_mla(layer, batch)).abs().max().item() <= 1e-5


@needs_the_engines_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_in_low_and_full_precision_against_reference_backend(isa, dtype):
    """q and cache in `dtype` (bf16 in and out without conversions), several query tokens, contexts across the
    kernel's 64-row tiles."""
    config = AttentionConfig(block_size=16, decode_threshold=2, decode_backend="NATIVE")
    requests = [Request(300, 1), Request(64, 2), Request(9, 1), Request(150, 2)]
    layer, builder, cache = _native_layer(config, 80, isa, kv_cache_dtype=dtype)
    batch = make_batch_with_layout(requests, cache, 16, "mixed", seed=5, write_new=True)
    md = builder.build(batch.common).decode
    q = torch.randn(batch.common.num_actual_tokens, MLA.num_heads, MLA.kv_cache_dim,
                    generator=torch.Generator().manual_seed(1)).to(dtype)
    out = layer.decode_backend.forward(q, cache, md)
    ref = ReferenceDecodeBackend(MLA.num_heads, SCALE, MLA.kv_lora_rank, MLA.qk_rope_head_dim).forward(
        q.float(), cache.float(), md)
    assert out.dtype == dtype and not torch.isnan(out).any()
    assert (out.float() - ref).abs().max().item() <= (2e-2 if dtype == torch.bfloat16 else 1e-5)


@needs_the_engines_kernels
@pytest.mark.parametrize("isa", ISAS)
def test_bf16_cache_under_fp32_queries(isa):
    config = AttentionConfig(block_size=16, decode_backend="NATIVE")
    layer, builder, cache = _native_layer(config, 40, isa, kv_cache_dtype=torch.bfloat16)
    batch = make_batch_with_layout([Request(150, 1), Request(20, 1), Request(90, 1)], cache, 16, "mixed", seed=2)
    out = run_layer(layer, builder, batch)
    assert out.dtype == torch.float32 and (out - naive_mla(layer, batch, torch.bfloat16)).abs().max().item() <= 2e-2


def _decode_metadata(query_lens: list[int], seq_lens: list[int], block_table: torch.Tensor) -> MLADecodeMetadata:
    qsl = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return MLADecodeMetadata(block_table=block_table, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                             query_start_loc=qsl, max_query_len=max(query_lens), max_seq_len=max(seq_lens))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_deepseek_shapes_and_every_split_of_heads(isa, threads):
    """DeepSeek's 512 + 64 rows and 13 heads (not a multiple of the 8 a work item takes), over 1-3 threads: items
    of 1 to 8 heads; a 700-token context and a 2-token verification."""
    mla = MLAConfig(num_heads=13, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    g = torch.Generator().manual_seed(3)
    block_size, seq_lens, query_lens = 16, [700, 33], [1, 2]
    blocks = [-(-s // block_size) for s in seq_lens]
    cache = torch.randn(sum(blocks) + 3, block_size, mla.kv_cache_dim, generator=g).bfloat16()
    perm = torch.randperm(cache.shape[0], generator=g)[: sum(blocks)].to(torch.int32)
    table = torch.zeros(2, max(blocks), dtype=torch.int32)
    table[0, : blocks[0]], table[1, : blocks[1]] = perm[: blocks[0]], perm[blocks[0]:]
    md = _decode_metadata(query_lens, seq_lens, table)
    q = torch.randn(3, mla.num_heads, mla.kv_cache_dim, generator=g).bfloat16()
    backend = NativeMQADecodeBackend(mla.num_heads, 0.07, mla.kv_lora_rank, mla.qk_rope_head_dim)
    backend.kernels = kernels(isa)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = backend.forward(q, cache, md)
    finally:
        torch.set_num_threads(previous)
    ref = ReferenceDecodeBackend(mla.num_heads, 0.07, mla.kv_lora_rank, mla.qk_rope_head_dim).forward(
        q.float(), cache.float(), md)
    assert (out.float() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()


@needs_the_engines_kernels
def test_selector_prefers_native_on_cpu_and_falls_back_without_the_kernels(monkeypatch):
    from tests.attention.test_registry import CFG

    assert get_mla_decode_backend("cpu", CFG) is NativeMQADecodeBackend
    assert NativeMQADecodeBackend.validate_configuration("cuda", CFG)
    assert NativeMQADecodeBackend.validate_configuration("cpu", dataclasses.replace(CFG, dtype=torch.float16))
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    assert get_mla_decode_backend("cpu", CFG) is PagedMQADecodeBackend
    with pytest.raises(ValueError, match=r"NATIVE is not available here: latentserve's kernels are not used "
                       r"\(LATENTSERVE_NATIVE_KERNELS=0\)"):
        get_mla_decode_backend("cpu", CFG, "NATIVE")


def test_refuses_what_it_cannot_read():
    backend = NativeMQADecodeBackend(4, 0.1, 32, 8)
    md = _decode_metadata([1], [5], torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"q must be a CPU tensor, contiguous float32 or bfloat16"):
        backend.forward(torch.zeros(1, 4, 40, dtype=torch.float16), torch.zeros(2, 16, 40), md)
    with pytest.raises(ValueError, match=r"kv_cache must be a CPU tensor, contiguous float32 or bfloat16 or "
                                         r"float8_e4m3fn or int8 \[\*, \*, 40\]"):
        backend.forward(torch.zeros(1, 4, 40), torch.zeros(2, 16, 48), md)


@needs_the_engines_kernels
def test_a_cache_dtype_it_cannot_read_goes_to_paged(monkeypatch):
    backend = NativeMQADecodeBackend(4, SCALE, 32, 8)
    g = torch.Generator().manual_seed(4)
    cache = torch.randn(80, 16, 40, generator=g).bfloat16()
    q = torch.randn(1, 4, 40, generator=g).bfloat16()
    table = torch.arange(80, dtype=torch.int32)[None]
    calls = []
    monkeypatch.setattr(backend.paged, "forward", lambda *a, _f=backend.paged.forward: calls.append(1) or _f(*a))
    backend.forward(q, cache, _decode_metadata([1], [1200], table))  # a lone long bf16 request: native
    assert calls == []
    out = backend.forward(q.float(), cache.half(), _decode_metadata([1], [9], table))
    assert calls == [1] and out.dtype == torch.float32


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_past_the_vector_width(isa, dtype):
    """Latent and rope widths that leave columns past the kernels' vector blocks (48 + 8: 16 latent columns past a
    32-column block, 24 past a 32-column row block), an odd number of positions."""
    g = torch.Generator().manual_seed(6)
    cache = torch.randn(12, 8, 56, generator=g).to(dtype)
    table = torch.randperm(12, generator=g)[:10].to(torch.int32)[None]
    md = _decode_metadata([2], [77], table)
    q = torch.randn(2, 5, 56, generator=g).to(dtype)
    backend = NativeMQADecodeBackend(5, 0.11, 48, 8)
    backend.kernels = kernels(isa)
    out = backend.forward(q, cache, md)
    ref = ReferenceDecodeBackend(5, 0.11, 48, 8).forward(q.float(), cache.float(), md)
    assert (out.float() - ref).abs().max().item() <= (2e-2 if dtype == torch.bfloat16 else 1e-5)


def fp8_cache(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """An e4m3 cache of random codes below 2 in magnitude (subnormals among them; no NaN codes)."""
    magnitude = torch.randint(0, 0x40, shape, generator=g, dtype=torch.uint8)
    sign = torch.randint(0, 2, shape, generator=g, dtype=torch.uint8) << 7
    return (magnitude | sign).view(torch.float8_e4m3fn)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dims", [(48, 8), (512, 64)])  # 56: columns past the vector blocks
def test_fp8_cache_read_in_place_against_naive_fp32_over_the_dequantized_cache(isa, dtype, dims):
    """An fp8 cache dequantized in registers: the reference attends over torch's dequantized copy in fp32; with
    fp32 queries the kernel's only differences are its summation order, a chunked context (> 256 positions)
    included."""
    latent, rope = dims
    g = torch.Generator().manual_seed(latent)
    cache = fp8_cache((40, 16, latent + rope), g)
    table = torch.randperm(40, generator=g)[:36].to(torch.int32).view(2, 18)
    md = _decode_metadata([1, 2], [281, 100], table)
    q = torch.randn(3, 5, latent + rope, generator=g).to(dtype)
    backend = NativeMQADecodeBackend(5, 0.11, latent, rope)
    backend.kernels = kernels(isa)
    assert backend.runs_natively(cache)
    out = backend.forward(q, cache, md)
    ref = ReferenceDecodeBackend(5, 0.11, latent, rope).forward(q.float(), cache.float(), md)
    assert out.dtype == dtype
    assert (out.float() - ref).abs().max().item() <= (2e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_fp8_code_dequantizes_exactly(isa, dtype):
    """A one-position context: the output is that row's latent itself (weight 1), so each of e4m3's 254 finite
    codes (subnormals, both signs; the rows' 256 latent columns) must come out as torch's dequantized value."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[codes & 0x7f == 0x7f] = 0  # the NaN codes, which the cache never holds
    cache = torch.cat([codes, torch.zeros(64, dtype=torch.uint8)]).view(torch.float8_e4m3fn).expand(2, 1, -1)
    q = torch.randn(2, 3, 320, generator=torch.Generator().manual_seed(0)).to(dtype)
    backend = NativeMQADecodeBackend(3, 0.1, 256, 64)
    backend.kernels = kernels(isa)
    out = backend.forward(q, cache.contiguous(), _decode_metadata([1, 1], [1, 1], torch.tensor([[0], [1]],
                                                                                             dtype=torch.int32)))
    assert torch.equal(out.float(), cache[:, 0, :256].float()[:, None].expand(2, 3, 256))


@pytest.mark.parametrize("isa", ISAS)
def test_long_contexts_split_in_chunks_give_each_token_the_same_result_in_any_batch(isa):
    """A token's positions go to work items of 256 (partial softmaxes combined after): fixed by the token alone, so
    its output is the same, bit for bit, over 1-3 threads and beside other requests; and matches the reference."""
    mla = MLAConfig(num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    g = torch.Generator().manual_seed(4)
    block_size, seq_lens = 16, [1000, 257, 40]
    blocks = [-(-s // block_size) for s in seq_lens]
    cache = torch.randn(sum(blocks), block_size, mla.kv_cache_dim, generator=g).bfloat16()
    table = torch.zeros(3, max(blocks), dtype=torch.int32)
    perm, start = torch.randperm(sum(blocks), generator=g).to(torch.int32), 0
    for r, b in enumerate(blocks):
        table[r, :b], start = perm[start : start + b], start + b
    q = torch.randn(3, mla.num_heads, mla.kv_cache_dim, generator=g).bfloat16()
    backend = NativeMQADecodeBackend(mla.num_heads, 0.07, mla.kv_lora_rank, mla.qk_rope_head_dim)
    backend.kernels = kernels(isa)
    previous, outs = torch.get_num_threads(), []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(backend.forward(q, cache, _decode_metadata([1, 1, 1], seq_lens, table)))
        alone = backend.forward(q[:1], cache, _decode_metadata([1], seq_lens[:1], table[:1]))
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(outs[0], other) for other in outs[1:])
    assert torch.equal(alone, outs[0][:1])
    ref = ReferenceDecodeBackend(mla.num_heads, 0.07, mla.kv_lora_rank, mla.qk_rope_head_dim).forward(
        q.float(), cache.float(), _decode_metadata([1, 1, 1], seq_lens, table))
    assert (outs[0].float() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()


def int8_cache(blocks: int, block_size: int, latent: int, rope: int, g: torch.Generator) -> torch.Tensor:
    """An int8 cache of random values and scales (kernels/kv_rows.h: [c_kv ‖ k_pe] int8, then their fp32 scales);
    some rows all zeros at scale 0, as an all-zero part is stored."""
    values = torch.randint(-127, 128, (blocks, block_size, latent + rope), generator=g, dtype=torch.int8)
    scales = torch.empty(blocks, block_size, 2).uniform_(1e-3, 1.5e-2, generator=g)  # values below 2, as fp8_cache
    values[0, :2], scales[0, :2] = 0, 0.0
    return torch.cat([values, scales.view(torch.int8)], dim=-1)


def naive_int8_dequantized(cache: torch.Tensor, latent: int) -> torch.Tensor:
    """The cache in fp32: each value times its part's scale."""
    scales = cache[..., -8:].contiguous().view(torch.float32)
    values = cache[..., :-8].float()
    return torch.cat([values[..., :latent] * scales[..., :1], values[..., latent:] * scales[..., 1:]], dim=-1)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dims, heads", [((48, 8), 5), ((512, 64), 20)])  # 56: past the vector blocks; 20: 3 groups
def test_int8_cache_read_in_place_against_naive_fp32_over_the_dequantized_cache(isa, dtype, dims, heads):
    """An int8 cache read in place (a tile dequantized at a time): the reference attends over the naive fp32
    dequantization; with fp32 queries the kernel differs only in its summation order, with bf16 ones also by the
    dequantized values' rounding to bf16. A chunked context (> 256 positions) included."""
    latent, rope = dims
    g = torch.Generator().manual_seed(latent + heads)
    cache = int8_cache(40, 16, latent, rope, g)
    table = torch.randperm(40, generator=g)[:36].to(torch.int32).view(2, 18)
    table[0, 0] = 0  # the zero rows
    md = _decode_metadata([1, 2], [281, 100], table)
    q = torch.randn(3, heads, latent + rope, generator=g).to(dtype)
    backend = NativeMQADecodeBackend(heads, 0.11, latent, rope)
    backend.kernels = kernels(isa)
    assert backend.runs_natively(cache)
    out = backend.forward(q, cache, md)
    ref = ReferenceDecodeBackend(heads, 0.11, latent, rope).forward(q.float(), naive_int8_dequantized(cache, latent),
                                                                     md)
    assert out.dtype == dtype
    assert (out.float() - ref).abs().max().item() <= (2e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_int8_value_dequantizes_as_torch_does(isa, dtype):
    """A one-position context: the output is that row's latent itself (weight 1), so each int8 value (-127 .. 127)
    times its scale must come out as torch's fp32 product (rounded to bf16 for bf16 queries, as torch rounds it)."""
    values = torch.cat([torch.arange(-127, 128), torch.zeros(1 + 64)]).to(torch.int8)
    scales = torch.tensor([0.0123, 7.0])
    cache = torch.cat([values, scales.view(torch.int8)]).expand(2, 1, -1).contiguous()
    q = torch.randn(2, 3, 320, generator=torch.Generator().manual_seed(0)).to(dtype)
    backend = NativeMQADecodeBackend(3, 0.1, 256, 64)
    backend.kernels = kernels(isa)
    out = backend.forward(q, cache, _decode_metadata([1, 1], [1, 1], torch.tensor([[0], [1]], dtype=torch.int32)))
    expected = (values[:256].float() * scales[0]).to(dtype)
    assert torch.equal(out, expected[None, None].expand(2, 3, 256))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("cache_dtype", ["fp8", "int8"])
def test_quantized_rows_scored_as_dequantized_give_the_bits_of_a_dequantized_tile(isa, cache_dtype):
    """fp8 / int8 rows converted to bf16 a few rows at a time and scored by the item's heads in the vector lanes
    (AVX512-BF16): one token over 201 positions (one chunk, an odd last tile): on one thread its item takes all 16
    heads (16 lanes), on three an item takes 6 (8 lanes), so the two meet on every head and must agree bit for bit;
    both against the reference over the dequantized cache."""
    g = torch.Generator().manual_seed(9)
    latent, rope, heads = 512, 64, 16
    cache = fp8_cache((16, 16, latent + rope), g) if cache_dtype == "fp8" else int8_cache(16, 16, latent, rope, g)
    table = torch.randperm(16, generator=g)[:13].to(torch.int32)[None]
    md = _decode_metadata([1], [201], table)
    q = torch.randn(1, heads, latent + rope, generator=g).bfloat16()
    backend = NativeMQADecodeBackend(heads, 0.07, latent, rope)
    backend.kernels = kernels(isa)
    previous, outs = torch.get_num_threads(), []
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            outs.append(backend.forward(q, cache, md))
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(outs[0], outs[1])
    dequantized = cache.float() if cache_dtype == "fp8" else naive_int8_dequantized(cache, latent)
    ref = ReferenceDecodeBackend(heads, 0.07, latent, rope).forward(q.float(), dequantized, md)
    assert (outs[0].float() - ref).abs().max().item() <= 2e-2
