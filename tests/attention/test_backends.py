"""Every prefill and decode backend against the naive fp32 reference."""
import pytest
import torch

from latentserve.config import AttentionConfig
from tests.attention.mla_case import Request, make_batch, naive_mla, run_layer, setup

SCENARIOS = {
    "decode_only": [Request(5, 1), Request(17, 1), Request(1, 1), Request(40, 1)],
    "prefill_only": [Request(0, 7), Request(0, 1), Request(0, 23)],
    "mixed": [Request(9, 1), Request(33, 1), Request(0, 11), Request(14, 6), Request(0, 2)],
    "spec_decode": [Request(12, 3), Request(30, 4), Request(7, 2)],
    "long_context": [Request(150, 5), Request(90, 9), Request(0, 4)],
}


def _config(prefill: str, decode: str, block_size: int, scenario: str) -> AttentionConfig:
    # spec-decode-like batches go through the decode path; long context spans >= 3 workspace chunks.
    decode_threshold = 4 if scenario == "spec_decode" else 1
    workspace = 96 if scenario == "long_context" else 4096
    return AttentionConfig(
        block_size=block_size, decode_threshold=decode_threshold, workspace_tokens=workspace,
        prefill_backend=prefill, decode_backend=decode,
    )


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("prefill,decode", [("TORCH_SDPA", "TORCH"), ("REFERENCE", "REFERENCE")])
def test_backend_matches_naive_fp32(scenario, block_size, prefill, decode):
    config = _config(prefill, decode, block_size, scenario)
    requests = SCENARIOS[scenario]
    num_blocks = sum(-(-r.seq_len // block_size) for r in requests) + 3
    layer, builder, cache = setup(config, num_blocks)
    batch = make_batch(requests, cache, block_size, seed=block_size)
    md = builder.build(batch.common)
    if scenario == "long_context":
        assert len(md.prefill.chunked_context.slots) >= 3
    if scenario == "spec_decode":
        assert md.num_decodes == 3
    out = run_layer(layer, builder, batch)
    ref = naive_mla(layer, batch)
    assert not torch.isnan(out).any()
    assert (out - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("scenario", ["mixed", "long_context"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_half_precision_cache(scenario, cache_dtype):
    """bf16/fp16 storage of the cache: the reference sees the same rounded latents, so only the
    new-token path (kept in fp32 before writing) and accumulation differ; bound 2e-2."""
    config = _config("TORCH_SDPA", "TORCH", 16, scenario)
    requests = SCENARIOS[scenario]
    layer, builder, cache = setup(config, 40, kv_cache_dtype=cache_dtype)
    batch = make_batch(requests, cache, 16, seed=3)
    out = run_layer(layer, builder, batch)
    ref = naive_mla(layer, batch, cache_dtype)
    assert not torch.isnan(out).any()
    assert (out - ref).abs().max().item() <= 2e-2


def test_empty_context_prefill_with_chunk_plan_present():
    """A batch where one prefill has context and another has none: the empty one gets only its own tokens."""
    config = _config("TORCH_SDPA", "TORCH", 16, "long_context")
    requests = [Request(0, 5), Request(40, 3), Request(0, 1)]
    layer, builder, cache = setup(config, 20)
    batch = make_batch(requests, cache, 16)
    out = run_layer(layer, builder, batch)
    assert (out - naive_mla(layer, batch)).abs().max().item() <= 1e-5
