"""Every prefill and decode backend against the naive fp32 reference."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from latentserve.attention.prefill.torch_sdpa import TorchSDPAPrefillBackend, _widen
from latentserve.config import AttentionConfig
from tests.attention.mla_case import Request, make_batch, naive_mla, run_layer, setup
from tests.kernels.builds import needs_the_engines_kernels

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
@pytest.mark.parametrize("prefill,decode", [pytest.param("NATIVE", "NATIVE", marks=needs_the_engines_kernels),
                                            ("TORCH_SDPA", "TORCH"), ("REFERENCE", "REFERENCE")])
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


def test_sdpa_widens_v_over_its_row_without_reading_it():
    """TORCH_SDPA views v wider over the columns left of it (MLA's key columns); those may hold anything."""
    gen = torch.Generator().manual_seed(0)
    row = torch.randn(7, 3, 40, generator=gen)
    v = row[..., 24:]  # 16 columns; 24 to their left
    wide, first = _widen(v, 24)
    assert first == 8 and wide.data_ptr() == row[..., 16:].data_ptr() and torch.equal(wide[..., first:], v)
    fresh, first = _widen(v.contiguous(), 24)  # nothing to its left: padded instead
    assert first == 0 and torch.equal(fresh[..., :16], v) and not fresh[..., 16:].any()

    q, k = torch.randn(2, 7, 3, 24, generator=gen).unbind()
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    ).transpose(0, 1)
    row[..., :24] = float("nan")  # whatever lies left of v stays out of the kept columns
    backend = TorchSDPAPrefillBackend(3, 24**-0.5, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                      v_head_dim=16)
    out, lse = backend._attend(q, k, v, causal=True, distance=0)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(lse).all()
    padded, _ = backend._attend(q, k, v.contiguous(), causal=True, distance=0)  # widened by padding: v's 16 columns
    torch.testing.assert_close(padded, expected, rtol=1e-5, atol=1e-5)


def test_sdpa_runs_bf16_where_the_cpu_flash_kernel_refuses_it():
    """Under `ATEN_CPU_CAPABILITY=avx2` on a CPU with AMX, torch's CPU flash kernel raises on bf16 blocks of 64
    queries and keys or more; TORCH_SDPA then runs them in fp32. Elsewhere the kernel takes bf16 as it is. Either
    way a bf16 prefill of 96 tokens matches REFERENCE within bf16's rounding."""
    script = textwrap.dedent("""
        import torch
        from latentserve.attention.prefill.reference import ReferencePrefillBackend
        from latentserve.attention.prefill.torch_sdpa import TorchSDPAPrefillBackend, cpu_flash_takes
        gen = torch.Generator().manual_seed(0)
        q, k = (torch.randn(96, 4, 24, generator=gen).bfloat16() for _ in range(2))
        v = torch.randn(96, 4, 16, generator=gen).bfloat16()
        dims = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
        out, lse = TorchSDPAPrefillBackend(4, 24**-0.5, **dims)._attend(q, k, v, causal=True, distance=0)
        ref, ref_lse = ReferencePrefillBackend(4, 24**-0.5, **dims)._attend(q, k, v, causal=True, distance=0)
        assert out.dtype == torch.bfloat16, out.dtype
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-2, atol=1e-2)
        print(torch.backends.cpu.get_cpu_capability(), cpu_flash_takes(torch.bfloat16))
    """)
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
