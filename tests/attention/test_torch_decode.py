"""TORCH decode in gather groups, in low and full precision, against the fp32 REFERENCE backend."""
import pytest
import torch

from latentserve.attention.decode.reference import ReferenceDecodeBackend
from latentserve.attention.decode.torch_mqa import TorchMQADecodeBackend, TorchPlan
from latentserve.config import AttentionConfig
from tests.attention.mla_case import MLA, SCALE, Request, setup
from tests.attention.test_paged_decode import make_batch_with_layout

# Lengths that differ within every group, cut blocks short and leave NaN rows past each request's end.
SINGLE = [Request(70, 1), Request(5, 1), Request(33, 1), Request(1, 1), Request(130, 1), Request(47, 1)]
MULTI = [Request(40, 3), Request(9, 1), Request(70, 2)]


def _run(requests, dtype, gather_bytes, monkeypatch, query_len=1):
    monkeypatch.setattr(TorchMQADecodeBackend, "gather_bytes", gather_bytes)
    config = AttentionConfig(block_size=16, decode_threshold=query_len, decode_backend="TORCH")
    layer, builder, cache = setup(config, 60, kv_cache_dtype=dtype)
    batch = make_batch_with_layout(requests, cache, 16, "fragmented", seed=len(requests), write_new=True)
    md = builder.build(batch.common).decode
    g = torch.Generator().manual_seed(2)
    q = torch.randn(batch.common.num_actual_tokens, MLA.num_heads, MLA.kv_cache_dim, generator=g).to(dtype)
    out = layer.decode_backend.forward(q, cache, md)
    reference = ReferenceDecodeBackend(MLA.num_heads, SCALE, MLA.kv_lora_rank, MLA.qk_rope_head_dim)
    return out, reference.forward(q.float(), cache.float(), md), md


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gather_bytes", [1, 45_000, 4 << 20], ids=["one_per_group", "groups", "one_group"])
def test_groups_match_reference(dtype, gather_bytes, monkeypatch):
    out, ref, md = _run(SINGLE, dtype, gather_bytes, monkeypatch)
    row_bytes = max(r.seq_len for r in SINGLE) * MLA.kv_cache_dim * dtype.itemsize
    size = max(1, gather_bytes // row_bytes)
    assert size == {1: 1, 45_000: 8 // dtype.itemsize}.get(gather_bytes, size)  # 2 or 4 of the 6 per group
    assert [g.end - g.start for g in md.backend_plan.groups] == [min(size, len(SINGLE) - s) for s in range(0, 6, size)]
    # bf16 stays bf16 (no upcast of the cache), and the rope columns never reach the output.
    assert out.dtype == dtype and out.shape == (len(SINGLE), MLA.num_heads, MLA.kv_lora_rank)
    assert not out.isnan().any()
    assert (out.float() - ref).abs().max().item() <= (2e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_several_query_tokens_match_reference(dtype, monkeypatch):
    out, ref, md = _run(MULTI, dtype, 1, monkeypatch, query_len=3)
    # Queries are padded per request: one group whatever the gather budget.
    assert [(g.start, g.end) for g in md.backend_plan.groups] == [(0, 3)]
    assert not out.isnan().any()
    assert (out.float() - ref).abs().max().item() <= (2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_plan_is_made_once_per_step_and_shared_by_layers(monkeypatch):
    out, _, md = _run(SINGLE, torch.float32, 45_000, monkeypatch)
    plan = md.backend_plan
    assert isinstance(plan, TorchPlan)
    other = TorchMQADecodeBackend(MLA.num_heads, SCALE, MLA.kv_lora_rank, MLA.qk_rope_head_dim)
    cache = torch.zeros(60, 16, MLA.kv_cache_dim)
    q = torch.randn(len(SINGLE), MLA.num_heads, MLA.kv_cache_dim)
    other.forward(q, cache, md)
    assert md.backend_plan is plan  # another layer, same step: same plan
    other.forward(q.to(torch.bfloat16), cache.to(torch.bfloat16), md)
    assert md.backend_plan is not plan  # rows half as wide: twice as many requests per group
    assert len(md.backend_plan.groups) < len(plan.groups)
