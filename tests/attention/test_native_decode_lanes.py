"""NATIVE decode with bf16 queries, where AVX512-BF16 builds score 16 heads in the vector lanes (kernels/mla_lanes.h),
against the naive fp32 reference over the (dequantized) cache: odd context lengths around the 8-row passes, the
64-row tiles and the 256-position chunks, 1-3 requests, 1-3 threads, bf16 / fp8 / int8 caches, one and two groups of
heads, an odd row width with columns past the 32-column blocks. Each head's lane computes it alone, so a token's
result must not depend on the threads or on the other requests of the batch (how the heads are split in items)."""
import pytest
import torch

from latentserve.attention.decode.native import NativeMQADecodeBackend
from latentserve.attention.decode.reference import ReferenceDecodeBackend
from tests.attention.test_native_decode import _decode_metadata, fp8_cache, int8_cache, naive_int8_dequantized
from tests.kernels.builds import ISAS, kernels, needs_a_build

pytestmark = needs_a_build

BLOCK = 16
BATCHES = [[4097], [255, 17], [1, 15, 257]]


def _cache(dtype: str, blocks: int, latent: int, rope: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache and its fp32 values as the reference reads them."""
    if dtype == "fp8":
        cache = fp8_cache((blocks, BLOCK, latent + rope), g)
        return cache, cache.float()
    if dtype == "int8":
        cache = int8_cache(blocks, BLOCK, latent, rope, g)
        return cache, naive_int8_dequantized(cache, latent)
    cache = torch.randn(blocks, BLOCK, latent + rope, generator=g).bfloat16()
    return cache, cache.float()


def _run(backend: NativeMQADecodeBackend, q: torch.Tensor, cache: torch.Tensor, seq_lens: list[int],
         table: torch.Tensor, threads: int) -> torch.Tensor:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return backend.forward(q, cache, _decode_metadata([1] * len(seq_lens), seq_lens, table))
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("cache_dtype", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize("heads, latent, rope", [(16, 512, 64), (20, 48, 9)])  # 20: a group of 16, one of 4
def test_odd_lengths_threads_and_batches_against_naive_fp32(isa, cache_dtype, heads, latent, rope):
    g = torch.Generator().manual_seed(heads + latent)
    blocks = [[-(-s // BLOCK) for s in batch] for batch in BATCHES]
    total = sum(map(sum, blocks))
    cache, values = _cache(cache_dtype, total, latent, rope, g)
    perm, start = torch.randperm(total, generator=g).to(torch.int32), 0
    tables = []
    for batch in blocks:
        table = torch.zeros(len(batch), max(batch), dtype=torch.int32)
        for r, b in enumerate(batch):
            table[r, :b], start = perm[start : start + b], start + b
        tables.append(table)
    backend = NativeMQADecodeBackend(heads, 0.07, latent, rope)
    backend.kernels = kernels(isa)
    assert backend.runs_natively(cache)
    reference = ReferenceDecodeBackend(heads, 0.07, latent, rope)
    for seq_lens, table in zip(BATCHES, tables):
        q = torch.randn(len(seq_lens), heads, latent + rope, generator=g).bfloat16()
        outs = [_run(backend, q, cache, seq_lens, table, threads) for threads in (1, 2, 3)]
        assert all(torch.equal(outs[0], other) for other in outs[1:]), seq_lens
        for r in range(len(seq_lens)):  # alone: its items split its heads otherwise
            alone = _run(backend, q[r : r + 1], cache, seq_lens[r : r + 1], table[r : r + 1], 2)
            assert torch.equal(alone, outs[0][r : r + 1]), (seq_lens, r)
        ref = reference.forward(q.float(), values, _decode_metadata([1] * len(seq_lens), seq_lens, table))
        assert outs[0].dtype == torch.bfloat16 and not torch.isnan(outs[0]).any()
        assert (outs[0].float() - ref).abs().max().item() <= 2e-2 * max(ref.abs().max().item(), 1.0), seq_lens
