"""The engine over an fp8 (e4m3) or int8 latent cache against the same engine over an fp32 cache: close prompt
logprobs and the same greedy tokens, through the native decode kernel (and the torch paths without the kernels),
prefix caching, chunked prefill's context read back from the cache in pieces, and DBO; the int8 rows' quantization
against its definition; and the combinations it refuses, by name."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from latentserve import LLM, SamplingParams
from latentserve.attention.kv_cache import allocate_kv_caches, dequantize_rows, quantize_int8_rows
from latentserve.engine.engine_config import parse_kv_cache_dtype
from tests.attention.mla_case import MLA
from tests.checkpoints import make_checkpoint

PROMPTS = [[5, 17, 33, 2, 9, 41, 77, 12, 60], [3, 88], list(range(10, 40)), [70, 71, 72, 73, 74]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=0, logprobs=0)
DBO = dict(enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=2)
# e4m3 keeps 3 mantissa bits (a relative step of 1/16 at worst); the tiny random model's logits are steep in its
# latents (measured: 0.33 at worst, against 4e-3 for a bf16 cache); the trained embedded model's perplexity moves by
# under 1e-3 (test_embedded_model_perplexity_over_an_fp8_cache).
FP8_LOGPROB_TOLERANCE = 0.5
QUANTIZED = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "int8": torch.int8, "q8_0": torch.int8}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "v3")


@pytest.fixture(scope="module")
def fp32_outputs(checkpoint):
    return _llm(checkpoint).generate(PROMPTS, PARAMS)


def _llm(path, **kwargs) -> LLM:
    defaults = dict(dtype="float32", block_size=4, num_kv_blocks=64, max_num_batched_tokens=256, num_threads=1,
                    enable_prefix_caching=False)
    return LLM(model=str(path), **{**defaults, **kwargs})


def _assert_close(outputs, expected, tolerance: float = FP8_LOGPROB_TOLERANCE) -> float:
    """The largest difference of the prompt tokens' logprobs, and of the generated tokens' while both runs chose
    the same (a near tie of the tiny random model may flip a greedy choice); each within `tolerance`."""
    drift = 0.0
    for out, ref in zip(outputs, expected, strict=True):
        for pos in range(1, len(ref.prompt_token_ids) if ref.prompt_logprobs else 0):
            token = ref.prompt_token_ids[pos]
            drift = max(drift, abs(out.prompt_logprobs[pos][token].logprob - ref.prompt_logprobs[pos][token].logprob))
        pairs = zip(out.outputs[0].logprobs, ref.outputs[0].logprobs, out.outputs[0].token_ids,
                    ref.outputs[0].token_ids)
        for ours, theirs, token, their_token in pairs:
            if token != their_token:
                break
            assert math.isfinite(ours[token].logprob)
            drift = max(drift, abs(ours[token].logprob - theirs[token].logprob))
    assert drift <= tolerance
    return drift


@pytest.mark.parametrize("name", list(QUANTIZED))
def test_quantized_cache_stays_close_to_an_fp32_cache(checkpoint, fp32_outputs, name):
    """An 8-token step budget: most prompt positions attend context read back from the quantized cache (a prompt
    prefilled in one step attends its own latents unquantized, as in vLLM), and decode reads it in place."""
    llm = _llm(checkpoint, kv_cache_dtype=name, max_num_batched_tokens=8)
    assert all(c.dtype == QUANTIZED[name] for c in llm.engine.runner.kv_caches.values())
    assert _assert_close(llm.generate(PROMPTS, PARAMS), fp32_outputs) > 1e-4  # the cache really is quantized


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_quantized_cache_in_bf16_compute(checkpoint, fp32_outputs, name):
    _assert_close(_llm(checkpoint, dtype="bfloat16", kv_cache_dtype=name).generate(PROMPTS, PARAMS), fp32_outputs,
                  2 * FP8_LOGPROB_TOLERANCE)


@pytest.mark.parametrize("decode_backend", ["TORCH", "PAGED", "REFERENCE"])
def test_int8_cache_without_the_kernels_matches_the_kernels(checkpoint, monkeypatch, decode_backend):
    """Without latentserve's kernels the torch paths write the int8 rows (the same bytes as the prologue: test_prologue)
    and dequantize what they read: the outputs match the kernels' run up to summation order."""
    native_run = _llm(checkpoint, kv_cache_dtype="int8", max_num_batched_tokens=8).generate(PROMPTS, PARAMS)
    monkeypatch.setenv("LATENTSERVE_NATIVE_KERNELS", "0")
    llm = _llm(checkpoint, kv_cache_dtype="int8", max_num_batched_tokens=8, decode_backend=decode_backend)
    assert _assert_close(llm.generate(PROMPTS, PARAMS), native_run, 1e-3) < 1e-3


def test_int8_rows_quantize_each_part_to_its_largest_magnitude():
    """Against the definition: scale = amax / 127 per part (0 for an all-zero part), each value within half a step
    of its dequantized one, the largest magnitude exact; zero rope dims (NoPE layers) allowed."""
    g = torch.Generator().manual_seed(0)
    kv_c, k_pe = torch.randn(5, 24, generator=g) * 3, torch.randn(5, 8, generator=g) * 40
    kv_c[1] = 0.0
    rows = quantize_int8_rows(kv_c, k_pe)
    assert rows.dtype == torch.int8 and rows.shape == (5, 24 + 8 + 8)
    scales = rows[:, -8:].contiguous().view(torch.float32)
    assert torch.equal(scales[:, 0], kv_c.abs().amax(-1) / 127) and torch.equal(scales[:, 1], k_pe.abs().amax(-1) / 127)
    back = dequantize_rows(rows, 24, torch.float32)
    assert (back - torch.cat([kv_c, k_pe], -1)).abs().le(torch.cat([scales[:, :1].expand(-1, 24),
                                                                    scales[:, 1:].expand(-1, 8)], -1) / 2).all()
    assert torch.equal(back[1, :24], torch.zeros(24)) and rows[:, :-8].abs().amax(-1).eq(127)[[0, 2, 3, 4]].all()
    assert quantize_int8_rows(kv_c, k_pe[:, :0]).shape == (5, 24 + 8)


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_embedded_model_perplexity_over_a_quantized_cache(name):
    """The trained embedded model (bf16) scores a passage in 16-token prefill chunks, each attending the cache's
    latents: perplexity within 1.005x the bf16 cache's (the issue's target; measured 1.0004x for fp8, int8 in
    docs/kv_cache_dtypes.md)."""
    from benchmarks.kv_cache_dtypes import PASSAGE

    perplexities = []
    for name in ("bfloat16", name):
        llm = LLM(kv_cache_dtype=name, max_num_batched_tokens=16, enable_prefix_caching=False, num_threads=1)
        out = llm.generate([PASSAGE[:600]], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        logprobs = [out.prompt_logprobs[p][t].logprob for p, t in enumerate(out.prompt_token_ids) if p > 0]
        perplexities.append(math.exp(-sum(logprobs) / len(logprobs)))
    assert perplexities[1] != perplexities[0] and perplexities[1] <= 1.005 * perplexities[0]


@pytest.mark.parametrize("name", ["fp8", "int8"])
def test_quantized_cache_under_prefix_caching_chunked_prefill_and_dbo(checkpoint, fp32_outputs, name):
    """Prefix hits read quantized latents back; an 8-token step budget and a 4-token workspace make prefill gather
    (and dequantize) its context chunk by chunk; DBO splits each step in two ubatches."""
    shared = list(range(40, 52))
    prompts = [shared + [1, 2], shared + [3, 4]]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)  # prompt logprobs: no hits
    plain = _llm(checkpoint).generate(prompts, greedy)
    cached = _llm(checkpoint, kv_cache_dtype=name, enable_prefix_caching=True)
    cached.generate(prompts[:1], greedy)
    second = cached.generate(prompts[1:], greedy)[0]
    assert second.num_cached_tokens >= 12
    _assert_close([second], plain[1:])

    chunked = _llm(checkpoint, kv_cache_dtype=name, max_num_batched_tokens=8, max_num_seqs=4, workspace_tokens=4)
    chunks = []
    for builder in chunked.engine.runner.builders:
        plan = builder._plan_context_chunks
        builder._plan_context_chunks = lambda *a, plan=plan: chunks.append(plan(*a)) or chunks[-1]
    _assert_close(chunked.generate(PROMPTS, PARAMS), fp32_outputs)
    assert max(len(c.slots) for c in chunks) >= 5

    # A prefill split in two ubatches reads the first one's latents back from the cache: quantized, so DBO is
    # compared with the fp32 cache, not bit for bit with the quantized cache without DBO.
    dbo = _llm(checkpoint, kv_cache_dtype=name, **DBO)
    execute, ubatches = dbo.engine.runner.execute_model, []

    def spy(out):
        result = execute(out)
        ubatches.append(result.num_ubatches)
        return result

    dbo.engine.runner.execute_model = spy
    _assert_close(dbo.generate(PROMPTS, PARAMS), fp32_outputs)
    assert 2 in ubatches


@pytest.mark.parametrize("dtype, kind", [(torch.float8_e4m3fn, "fp8"), (torch.int8, "int8")])
def test_unsupported_formats_and_combinations_are_refused_by_name(dtype, kind):
    with pytest.raises(ValueError, match="'fp8_e5m2' is not supported; the fp8 cache is e4m3"):
        parse_kv_cache_dtype("fp8_e5m2", torch.float32)
    dsa_layer = SimpleNamespace(mla=MLA, extra_cache_dims={"indexer_k": 16}, extra_caches={})
    with pytest.raises(ValueError, match=rf"layer.0: an {kind} KV cache is not supported with the extra caches "
                                         r"\['indexer_k'\] \(DSA's indexer keys\)"):
        allocate_kv_caches({"layer.0": dsa_layer}, 4, 4, dtype)


@pytest.mark.parametrize("command", ["serve", "generate", "chat", "bench"])
@pytest.mark.parametrize("name", ["int8", "q8_0", "fp8"])
def test_every_command_takes_the_quantized_cache_dtypes(command, name):
    from latentserve.cli import make_parser

    args = make_parser().parse_args([command, "--kv-cache-dtype", name])
    assert args.kv_cache_dtype == name and parse_kv_cache_dtype(name, torch.bfloat16) == QUANTIZED[name]


def test_the_memory_budget_counts_the_int8_rows_scales(checkpoint):
    """An int8 row is L + R values and two fp32 scales: a byte budget holds as many blocks as such rows fit."""
    budget = 1 << 20
    llm = _llm(checkpoint, kv_cache_dtype="int8", num_kv_blocks=None, kv_cache_memory_bytes=budget)
    layer = next(iter(llm.engine.runner.model.static_forward_context.values()))
    caches = list(llm.engine.runner.kv_caches.values())
    blocks, block_size, width = caches[0].shape
    assert caches[0].dtype == torch.int8 and width == layer.mla.kv_cache_dim + 8
    assert blocks == budget // (block_size * width * len(caches))
