"""Speculative decoding in the engine: greedy outputs equal those without it, and the KV cache after rejections
holds what a run without speculation holds."""
from __future__ import annotations

import pytest
import torch

from latentserve import LLM, SamplingParams
from latentserve.engine.spec_decode import SpeculativeConfig
from latentserve.engine.spec_decode import build as spec_build
from latentserve.engine.spec_decode.config import auto_policy
from tests.models.mtp_checkpoint import make_mtp_checkpoint, reference_mtp_logprobs

VOCAB = 6  # random drafts then agree with the target often enough that both acceptance and rejection happen
ENGINE = dict(dtype="float32", num_threads=1, num_kv_blocks=96, block_size=4, max_num_batched_tokens=256,
              max_model_len=96)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, _, _ = make_mtp_checkpoint(tmp_path_factory.mktemp("mtp"), vocab_size=VOCAB)
    return path


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _spec(k: int) -> dict:
    """Drafting at every batch size (the default drafts at one request at most)."""
    return {"method": "mtp", "num_speculative_tokens": k, "disable_by_batch_size": None}


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def baseline(checkpoint):
    return LLM(model=checkpoint, **ENGINE)


@pytest.mark.parametrize("k, batch, dbo", [(1, 1, False), (2, 4, False), (3, 16, False), (2, 16, True)])
def test_greedy_tokens_equal_those_without_speculation(checkpoint, baseline, k: int, batch: int, dbo: bool) -> None:
    prompts = _prompts(batch, seed=batch)
    # Different lengths make requests finish mid-draft (max_tokens cuts a verification short).
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 3 * (i % 4), ignore_eos=True) for i in range(batch)]
    dbo_args = dict(enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=2) if dbo else {}
    llm = LLM(model=checkpoint, speculative_config=_spec(k), **ENGINE,
              **dbo_args)
    assert _tokens(llm, prompts, params) == _tokens(baseline, prompts, params)
    stats = llm.engine.spec_decoding_stats
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both outcomes seen


def test_greedy_with_every_logits_processor_equals_without_speculation(checkpoint, baseline) -> None:
    """Requests whose target does not depend on their own new tokens are verified (bias, allowed tokens); the
    others (penalties, min_tokens, logprobs) decode a token a step in the same batch."""
    prompts = _prompts(6, seed=9)
    greedy = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
    params = [
        SamplingParams(**greedy, logit_bias={1: 2.0, 3: -1.0}),
        SamplingParams(**greedy, allowed_token_ids=[0, 2, 3, 5]),
        SamplingParams(**greedy, repetition_penalty=1.3),
        SamplingParams(**greedy, min_tokens=6),
        SamplingParams(**greedy, logprobs=2),
        SamplingParams(**greedy),
    ]
    llm = LLM(model=checkpoint, speculative_config=_spec(2), **ENGINE)
    ours, theirs = llm.generate(prompts, params), baseline.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in theirs]
    for mine, ref in zip(ours[4].outputs[0].logprobs, theirs[4].outputs[0].logprobs):
        assert mine.keys() == ref.keys() and all(abs(mine[t].logprob - ref[t].logprob) < 1e-5 for t in ref)
    assert llm.engine.spec_decoding_stats.num_accepted_tokens > 0


def test_greedy_equality_under_preemption_and_chunked_prefill(checkpoint, baseline, monkeypatch) -> None:
    """A small pool preempts (drafts are dropped, both caches recomputed), a small budget chunks prompts and
    trims drafts."""
    prompts = _prompts(12, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    tight = {**ENGINE, "num_kv_blocks": 30, "max_num_batched_tokens": 16, "max_model_len": 64}
    llm = LLM(model=checkpoint, speculative_config=_spec(2), **tight)
    preempted = []
    preempt = llm.engine.scheduler._preempt
    monkeypatch.setattr(llm.engine.scheduler, "_preempt", lambda r: (preempted.append(r), preempt(r)))
    assert _tokens(llm, prompts, params) == _tokens(baseline, prompts, params)
    assert preempted and llm.engine.spec_decoding_stats.num_accepted_tokens > 0


def test_disable_by_batch_size(checkpoint, baseline) -> None:
    prompts = _prompts(4, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    off = LLM(model=checkpoint, speculative_config={**spec, "disable_by_batch_size": 3}, **ENGINE)
    assert _tokens(off, prompts, params) == _tokens(baseline, prompts, params)
    assert off.engine.spec_decoding_stats.num_drafts == 0  # four requests ran together throughout
    on = LLM(model=checkpoint, speculative_config={**spec, "disable_by_batch_size": 4}, **ENGINE)
    assert _tokens(on, prompts, params) == _tokens(baseline, prompts, params)
    assert on.engine.spec_decoding_stats.num_drafts > 0


def test_auto_policy_drafts_where_verification_is_cheap() -> None:
    mib = 2**20
    assert SpeculativeConfig.from_value({"method": "mtp"}).disable_by_batch_size == "auto"
    fits = auto_policy(20 * mib, "cpu", 32 * mib)
    assert fits.max_batch_size == 0 and "fit in the CPU's last-level cache (32 MiB)" in fits.reason
    assert auto_policy(200 * mib, "cpu", 32 * mib).max_batch_size == 1
    assert auto_policy(20 * mib, "cpu", None).max_batch_size == 1  # cache unknown: assumed streamed
    assert auto_policy(20 * mib, "cuda", 32 * mib).max_batch_size is None
    explicit = SpeculativeConfig(disable_by_batch_size=3).drafting_policy(20 * mib, "cpu", 32 * mib)
    assert explicit.max_batch_size == 3


@pytest.mark.parametrize("cache_bytes", [1, 2**40])
def test_auto_drafting_follows_the_policy(checkpoint, baseline, monkeypatch, caplog, cache_bytes: int) -> None:
    """Weights streamed past the cache: drafting at one request and not at two; weights in the cache: never."""
    monkeypatch.setattr(spec_build, "last_level_cache_bytes", lambda: cache_bytes)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = LLM(model=checkpoint, speculative_config={"method": "mtp", "num_speculative_tokens": 1}, **ENGINE)
    assert llm.engine.drafting_policy.max_batch_size == (1 if cache_bytes == 1 else 0)
    assert ("drafting off" in caplog.text) == (cache_bytes != 1)
    prompts = _prompts(2, seed=8)
    assert _tokens(llm, prompts, params) == _tokens(baseline, prompts, params)
    assert llm.engine.spec_decoding_stats.num_drafts == 0  # two requests ran together throughout
    assert _tokens(llm, prompts[:1], params) == _tokens(baseline, prompts[:1], params)
    assert (llm.engine.spec_decoding_stats.num_drafts > 0) == (cache_bytes == 1)


def test_kv_cache_after_rejections_equals_a_run_without_speculation(checkpoint) -> None:
    prompt = _prompts(1, seed=3)[0]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engines = [LLM(model=checkpoint, **ENGINE),
               LLM(model=checkpoint, speculative_config=_spec(3), **ENGINE)]
    requests = []
    for llm in engines:
        llm.engine.add_request(prompt, params, request_id="r")
        requests.append(llm.engine.scheduler.requests["r"])
    plain, spec = requests
    checked = 0
    while spec.num_output_tokens < 30:
        engines[1].engine.step()
        while plain.num_computed_tokens < spec.num_computed_tokens:
            engines[0].engine.step()
        n = spec.num_computed_tokens
        for name, cache in engines[1].engine.runner.kv_caches.items():
            torch.testing.assert_close(_rows(cache, spec.block_ids, n), _rows(engines[0].engine.runner.kv_caches[name],
                                       plain.block_ids, n), rtol=0, atol=1e-5)
        checked += 1
    stats = engines[1].engine.spec_decoding_stats
    assert stats.num_accepted_tokens < stats.num_draft_tokens and checked > 5  # rejections happened


def test_drafts_follow_the_formula_over_the_main_models_normed_output(tmp_path, monkeypatch) -> None:
    """Each step's first draft logits are the naive formula's over the request's tokens so far: the engine hands
    the MTP the main model's output after its final norm (as DeepSeek-V3's layer expects), and after rejections
    the MTP's own cache holds exactly the accepted pairs."""
    path, reference, ref_mtp = make_mtp_checkpoint(tmp_path, vocab_size=VOCAB)
    llm = LLM(model=path, speculative_config=_spec(2), **ENGINE)
    mtp = llm.engine.runner.spec_decoder.proposer.mtp
    drafted = []
    compute_logits = mtp.compute_logits
    monkeypatch.setattr(mtp, "compute_logits", lambda h: drafted.append(compute_logits(h)) or drafted[-1])
    g = torch.Generator().manual_seed(4)
    checked = 0
    for i, n in enumerate((5, 13)):
        prompt = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        llm.engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), str(i))
        request = llm.engine.scheduler.requests[str(i)]
        while not request.is_finished:  # alone in its steps: row 0 of the first draft logits is its
            drafted.clear()
            llm.engine.step()
            if drafted and not request.is_finished:  # a finishing step's drafts are dropped
                expected = reference_mtp_logprobs(reference, ref_mtp, request.all_token_ids)[-1]
                torch.testing.assert_close(drafted[0][0].log_softmax(-1), expected, rtol=0, atol=1e-4)
                assert request.spec_token_ids[0] == int(expected.argmax())
                checked += 1
    stats = llm.engine.spec_decoding_stats
    assert checked > 10 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # rejections happened


def _rows(cache: torch.Tensor, blocks: list[int], n: int) -> torch.Tensor:
    """The cache rows of a request's first n positions."""
    bs = cache.shape[1]
    slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(n)])
    return cache.view(-1, cache.shape[-1])[slots]


def test_refusals(checkpoint, tmp_path) -> None:
    with pytest.raises(ValueError, match="method must be one of"):
        SpeculativeConfig.from_value({"method": "eagle"})
    with pytest.raises(ValueError, match="num_speculative_tokens must be an int >= 1"):
        SpeculativeConfig.from_value({"method": "mtp", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="disable_by_batch_size must be an int >= 1, None or 'auto'"):
        SpeculativeConfig.from_value({"method": "mtp", "disable_by_batch_size": "sometimes"})
    with pytest.raises(ValueError, match="unknown key"):
        SpeculativeConfig.from_value({"method": "mtp", "draft_model": "x"})
    from tests.checkpoints import make_checkpoint

    declared = make_checkpoint(tmp_path, "v3")  # transformers declares one MTP layer, and writes none
    with pytest.raises(ValueError, match="its MTP weights are missing"):
        LLM(model=declared, speculative_config={"method": "mtp"}, **ENGINE)
    none = make_checkpoint(tmp_path, "v3", seed=1, num_mtp_layers=0)
    with pytest.raises(ValueError, match="needs an MTP layer"):
        LLM(model=none, speculative_config={"method": "mtp"}, **ENGINE)


def _processed(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Naive temperature, then top-k, then top-p (the smallest likeliest set reaching top_p), renormalized."""
    probs = (logits.double() / temperature).softmax(-1)
    order = probs.argsort(descending=True)[:top_k]
    kept = probs[order] / probs[order].sum()
    cut = int((kept.cumsum(0) < top_p).sum()) + 1
    out = torch.zeros_like(probs)
    out[order[:cut]] = kept[:cut] / kept[:cut].sum()
    return out


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.8, 4, 0.9)])
def test_sampled_tokens_follow_the_models_distribution(checkpoint, temperature, top_k, top_p) -> None:
    """The first two generated tokens (the second often an accepted draft) against transformers' joint
    distribution of them, by a chi-square test."""
    from scipy.stats import chisquare

    from tests.checkpoints import load_reference

    reference = load_reference(checkpoint)
    prompt = _prompts(1, seed=7)[0]
    with torch.no_grad():
        first = _processed(reference(torch.tensor([prompt])).logits[0, -1], temperature, top_k or VOCAB, top_p)
        joint = torch.stack([
            first[t] * _processed(reference(torch.tensor([prompt + [t]])).logits[0, -1], temperature, top_k or VOCAB,
                                  top_p) for t in range(VOCAB)
        ]).flatten()
    llm = LLM(model=checkpoint, speculative_config=_spec(1), seed=0,
              **{**ENGINE, "max_num_seqs": 256, "num_kv_blocks": 1024})
    samples = 4000
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=3, ignore_eos=True)
    observed = torch.zeros(VOCAB * VOCAB, dtype=torch.float64)
    for a, b, _ in _tokens(llm, [prompt] * samples, params):
        observed[a * VOCAB + b] += 1
    assert llm.engine.spec_decoding_stats.num_accepted_tokens > samples // 10  # drafts did carry tokens
    assert observed[joint == 0].sum() == 0
    keep = joint * samples >= 5
    expected = torch.cat([joint[keep], joint[~keep].sum()[None]]) * samples
    counts = torch.cat([observed[keep], observed[~keep].sum()[None]])
    assert chisquare(counts[expected > 0], expected[expected > 0]).pvalue > 1e-3


@pytest.mark.parametrize("dbo", [False, True])
def test_greedy_equality_over_data_parallel_ranks_with_expert_parallelism(checkpoint, baseline, dbo: bool) -> None:
    """Each rank drafts with its own MTP layer (all experts local); the main model's experts are split. Under DBO
    the main forward runs as two ubatches, the MTP forward whole (it has no all-to-all to overlap)."""
    prompts = _prompts(4, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    dbo_args = dict(enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=2) if dbo else {}
    llm = LLM(model=checkpoint, data_parallel_size=2, enable_expert_parallel=True,
              speculative_config=_spec(2), **ENGINE, **dbo_args)
    try:
        assert _tokens(llm, prompts, params) == _tokens(baseline, prompts, params)
    finally:
        llm.shutdown()
