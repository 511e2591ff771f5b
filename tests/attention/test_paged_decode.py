"""PAGED decode (reads the paged cache in place) against the naive fp32 reference and the REFERENCE backend."""
import pytest
import torch

from latentserve.attention.decode.paged import PagedMQADecodeBackend, plan_pieces
from latentserve.attention.decode.reference import ReferenceDecodeBackend
from latentserve.attention.decode.selector import get_mla_decode_backend
from latentserve.config import AttentionConfig
from tests.attention.mla_case import MLA, SCALE, Batch, Request, fill_batch, naive_mla, run_layer, setup


def _layout(kind: str, blocks_needed: list[int], num_blocks: int, g: torch.Generator) -> list[list[int]]:
    """Block ids per request: one run each, all scattered, or long runs with scattered blocks between."""
    if kind == "fragmented":
        perm = torch.randperm(num_blocks, generator=g).tolist()
        out, offset = [], 0
        for n in blocks_needed:
            out.append(perm[offset : offset + n])
            offset += n
        return out
    if kind == "contiguous":
        out, offset = [], 0
        for n in blocks_needed:
            out.append(list(range(offset, offset + n)))
            offset += n
        return out
    # mixed: requests share a pool where every third block goes to a scattered tail region.
    pool = list(range(num_blocks))
    tail = pool[len(pool) // 2 :]
    head = pool[: len(pool) // 2]
    out = []
    for n in blocks_needed:
        ids = []
        while len(ids) < n:
            run = min(n - len(ids), 9)
            ids += head[:run]
            del head[:run]
            if len(ids) < n:
                ids.append(tail.pop(int(torch.randint(len(tail), (1,), generator=g))))
        out.append(ids)
    return out


def make_batch_with_layout(
    requests: list[Request], cache: torch.Tensor, block_size: int, kind: str, seed: int = 0, write_new: bool = False
) -> Batch:
    """Like mla_case.make_batch (NaN in every unused slot) but with the block layout chosen."""
    g = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-r.seq_len // block_size) for r in requests]
    layout = _layout(kind, blocks_needed, cache.shape[0], g)
    block_table = torch.zeros(len(requests), max(blocks_needed) + 2, dtype=torch.int32)
    for i, ids in enumerate(layout):
        block_table[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return fill_batch(requests, cache, block_table, block_size, g, write_new)


def test_plan_reads_long_runs_in_place_and_copies_short_ones():
    bs = 16
    # 3 consecutive blocks (48 rows < 64: copied), then 5 consecutive (80 rows: a view), then 2 scattered.
    blocks = [7, 8, 9, 20, 21, 22, 23, 24, 3, 11]
    seq_len = 9 * bs + 5  # the last block holds 5 positions
    pieces = plan_pieces(blocks, seq_len, bs, min_run_tokens=64)
    assert [p.num_rows for p in pieces] == [48, 80, bs + 5]
    assert pieces[0].block_ids.tolist() == [7, 8, 9] and pieces[1].block_ids is None
    assert pieces[1].flat_start == 20 * bs
    assert pieces[2].block_ids.tolist() == [3, 11]
    whole = plan_pieces(list(range(4, 40)), 300, bs, 64)
    assert len(whole) == 1 and whole[0].block_ids is None and whole[0].num_rows == 300
    # Entries past the request's last block (padding) are never planned.
    assert sum(p.num_rows for p in plan_pieces([5, 6, 0, 0], 17, bs, 64)) == 17


def test_selector_takes_paged_on_cpu_only_without_native_kernels(monkeypatch):
    from tests.attention.test_registry import CFG

    monkeypatch.setenv("LATENTSERVE_NATIVE_KERNELS", "0")
    assert get_mla_decode_backend("cpu", CFG) is PagedMQADecodeBackend
    assert PagedMQADecodeBackend.validate_configuration("cuda", CFG)


@pytest.fixture(params=[1, 8], ids=["batched", "in_place"])
def in_place_requests(request, monkeypatch):
    """Batches of more than this many requests take the batched path; 8 reads every test batch in place."""
    monkeypatch.setattr(PagedMQADecodeBackend, "max_in_place_requests", request.param)
    return request.param


@pytest.mark.parametrize("kind", ["contiguous", "fragmented", "mixed"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("query_len", [1, 3])
def test_paged_matches_naive_fp32(kind, block_size, query_len, in_place_requests):
    contexts = [5, 70, 200, 1, 131]
    requests = [Request(c, query_len) for c in contexts]
    config = AttentionConfig(block_size=block_size, decode_threshold=query_len, decode_backend="PAGED")
    num_blocks = 2 * sum(-(-r.seq_len // block_size) for r in requests) + 4
    layer, builder, cache = setup(config, num_blocks)
    assert isinstance(layer.decode_backend, PagedMQADecodeBackend)
    batch = make_batch_with_layout(requests, cache, block_size, kind, seed=block_size + query_len)
    md = builder.build(batch.common)
    assert md.num_decodes == len(requests)
    out = run_layer(layer, builder, batch)
    ref = naive_mla(layer, batch)
    assert not torch.isnan(out).any()
    assert (out - ref).abs().max().item() <= 1e-5


def test_plan_is_made_once_per_step_and_shared_by_layers(monkeypatch):
    monkeypatch.setattr(PagedMQADecodeBackend, "max_in_place_requests", 2)
    config = AttentionConfig(block_size=16, decode_backend="PAGED")
    layer, builder, cache = setup(config, 40)
    batch = make_batch_with_layout([Request(150, 1), Request(30, 1)], cache, 16, "contiguous")
    md = builder.build(batch.common)
    backend = layer.decode_backend
    q = torch.randn(2, MLA.num_heads, MLA.kv_cache_dim)
    backend.forward(q, cache, md.decode)
    plan = md.decode.backend_plan
    # The 150-token context is read in place; the 30-token one has nothing to: it goes with the batched path.
    assert plan.query_ranges == [(0, 1)] and plan.gathered.seq_lens.tolist() == [31]
    assert plan.gathered_tokens.tolist() == [1]
    other = PagedMQADecodeBackend(MLA.num_heads, SCALE, MLA.kv_lora_rank, MLA.qk_rope_head_dim)
    other.forward(q, cache, md.decode)
    assert md.decode.backend_plan is plan
    assert builder.build(batch.common).decode.backend_plan is None  # a new step plans afresh


@pytest.mark.parametrize("kind", ["contiguous", "mixed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_paged_in_low_and_full_precision_against_reference_backend(kind, dtype, in_place_requests):
    """The backend alone on q and cache in `dtype`, against the fp32 REFERENCE on the same values."""
    config = AttentionConfig(block_size=16, decode_threshold=2, decode_backend="PAGED")
    requests = [Request(300, 1), Request(64, 2), Request(9, 1), Request(150, 2)]
    layer, builder, cache = setup(config, 80, kv_cache_dtype=dtype)
    batch = make_batch_with_layout(requests, cache, 16, kind, seed=5, write_new=True)
    decode_md = builder.build(batch.common).decode
    g = torch.Generator().manual_seed(1)
    q = torch.randn(batch.common.num_actual_tokens, MLA.num_heads, MLA.kv_cache_dim, generator=g).to(dtype)
    out = layer.decode_backend.forward(q, cache, decode_md)
    reference = ReferenceDecodeBackend(MLA.num_heads, SCALE, MLA.kv_lora_rank, MLA.qk_rope_head_dim)
    ref = reference.forward(q.float(), cache.float(), decode_md)
    assert out.dtype == dtype and not torch.isnan(out).any()
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert (out.float() - ref).abs().max().item() <= tolerance


def test_half_precision_cache_under_full_precision_queries(in_place_requests):
    """A bf16 cache read by fp32 queries: views are cast on the fly; the reference sees the same rounded latents."""
    config = AttentionConfig(block_size=16, decode_backend="PAGED")
    requests = [Request(150, 1), Request(20, 1), Request(90, 1)]
    layer, builder, cache = setup(config, 40, kv_cache_dtype=torch.bfloat16)
    batch = make_batch_with_layout(requests, cache, 16, "mixed", seed=2)
    out = run_layer(layer, builder, batch)
    ref = naive_mla(layer, batch, torch.bfloat16)
    assert out.dtype == torch.float32 and not torch.isnan(out).any()
    assert (out - ref).abs().max().item() <= 2e-2


def test_only_a_lone_request_is_read_in_place():
    config = AttentionConfig(block_size=16, decode_backend="PAGED")
    layer, builder, cache = setup(config, 40)
    backend = layer.decode_backend
    assert backend.max_in_place_requests == 1
    batch = make_batch_with_layout([Request(150, 1), Request(140, 1)], cache, 16, "contiguous", write_new=True)
    md = builder.build(batch.common).decode
    q = torch.randn(2, MLA.num_heads, MLA.kv_cache_dim)
    out = backend.forward(q, cache, md)
    plan = md.backend_plan
    # Both go through TORCH, which plans on its own copy of the metadata and leaves PAGED's plan in place.
    assert plan.query_ranges == [] and plan.gathered is not md and plan.gathered.backend_plan is not None
    assert not out.isnan().any() and backend.forward(q, cache, md).equal(out) and md.backend_plan is plan
    lone = make_batch_with_layout([Request(150, 1)], cache, 16, "contiguous")
    lone_md = builder.build(lone.common).decode
    backend.forward(q[:1], cache, lone_md)
    assert lone_md.backend_plan.query_ranges == [(0, 1)] and lone_md.backend_plan.gathered is None
