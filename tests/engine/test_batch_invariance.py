"""Batch-invariant mode: a request's tokens and logprobs are the same, to the bit, alone and beside any other
requests, whatever the step's size, prefill chunking, prefix-cache hits and DBO split (the reference is the request
alone in a fresh engine)."""
import json
import random

import pytest
import torch

from latentserve import LLM, SamplingParams
from latentserve.engine.llm import default_model_dir
from latentserve.kernels.policy import default_policy

pytestmark = pytest.mark.skipif(default_policy().kernels is None, reason="latentserve's CPU kernels do not build here")

TARGET = "And God said, Let there be light: and there was light. And God saw the light, that it was good"
WORDS = ("the Lord spake unto Moses saying and the children of Israel went into the land of Egypt and God said "
         "let there be light").split()
# A small token budget: the target's prompt is split into chunks that depend on what else the step holds.
ENGINE = dict(max_num_seqs=32, max_num_batched_tokens=48, num_kv_blocks=512, batch_invariant=True)
TARGET_PARAMS = SamplingParams(temperature=1.0, seed=42, max_tokens=20, logprobs=5, prompt_logprobs=3)


def _outputs(out) -> tuple:
    """Everything a request returns that must not depend on its batch."""
    sample = out.outputs[0]
    return sample.token_ids, sample.text, sample.logprobs, sample.cumulative_logprob, out.prompt_logprobs


def _neighbours(rng: random.Random, n: int) -> tuple[list[str], list[SamplingParams]]:
    """n random requests: greedy or seeded or unseeded sampling, some with logprobs, some sharing the target's
    opening words (partial prefix-cache hits)."""
    prompts, params = [], []
    for _ in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60)))
        prompts.append(TARGET[: rng.randint(20, 60)] + text if rng.random() < 0.3 else text)
        params.append(SamplingParams(temperature=rng.choice([0.0, 0.7, 1.0]), max_tokens=rng.randint(1, 30),
                                     seed=rng.choice([None, rng.randrange(1000)]),
                                     logprobs=rng.choice([None, 2]), top_k=rng.choice([0, 20])))
    return prompts, params


@pytest.fixture(scope="module", params=[("float32", None), ("bfloat16", None), ("float32", "int8"),
                                        ("bfloat16", "int4")], ids=lambda p: "-".join(filter(None, p)))
def setting(request) -> tuple[str, str | None]:
    return request.param


@pytest.fixture(scope="module")
def alone(setting) -> tuple:
    dtype, quantization = setting
    llm = LLM(dtype=dtype, quantization=quantization, **ENGINE)
    return _outputs(llm.generate([TARGET], TARGET_PARAMS)[0])


@pytest.mark.parametrize("dbo", [False, True], ids=["whole", "dbo"])
def test_alone_equals_in_batches_of_2_to_32(setting, alone, dbo):
    dtype, quantization = setting
    split = dict(enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=2) if dbo else {}
    llm = LLM(dtype=dtype, quantization=quantization, **ENGINE, **split)
    rng = random.Random(0)
    for n in (2, 3, 5, 8, 13, 21, 32):
        prompts, params = _neighbours(rng, n - 1)
        at = rng.randrange(n)
        prompts.insert(at, TARGET)
        params.insert(at, TARGET_PARAMS)
        assert _outputs(llm.generate(prompts, params)[at]) == alone, f"batch of {n}, the target at {at}"


def test_seeded_sampling_under_concurrency(alone, setting):
    """The issue's case: 8 concurrent copies of a seeded request, in an engine that already served it (every copy
    but the first step's hits the prefix cache), each as the request alone."""
    dtype, quantization = setting
    llm = LLM(dtype=dtype, quantization=quantization, **ENGINE)
    assert _outputs(llm.generate([TARGET], TARGET_PARAMS)[0]) == alone
    outputs = llm.generate([TARGET] * 8, TARGET_PARAMS)
    assert [_outputs(o) for o in outputs] == [alone] * 8


def test_two_threads():
    """Threads split each product's outputs, never a row's sums: the same invariance on two threads."""
    previous = torch.get_num_threads()
    try:
        llm = LLM(num_threads=2, **ENGINE)
        reference = _outputs(llm.generate([TARGET], TARGET_PARAMS)[0])
        prompts, params = _neighbours(random.Random(1), 7)
        assert _outputs(llm.generate([TARGET, *prompts], [TARGET_PARAMS, *params])[0]) == reference
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("setting, message", [
    (dict(decode_backend="PAGED"), "decode_backend 'PAGED' (it needs NATIVE)"),
    (dict(dtype="float16"), "dtype torch.float16 (it needs float32 or bfloat16)"),
    (dict(kv_cache_dtype="float16"), "kv_cache_dtype torch.float16"),
    (dict(speculative_config={"method": "mtp", "num_speculative_tokens": 1}), "speculative decoding"),
])
def test_settings_it_cannot_honour_fail_at_start(setting, message):
    with pytest.raises(ValueError, match="batch_invariant=True cannot run with: .*" + message.replace("(", r"\(")
                       .replace(")", r"\)")):
        LLM(model=str(default_model_dir()), batch_invariant=True, **setting)


def test_without_native_kernels_it_fails_at_start(monkeypatch):
    monkeypatch.setenv("LATENTSERVE_NATIVE_KERNELS", "0")
    with pytest.raises(ValueError, match=r"latentserve's CPU kernels \(LATENTSERVE_NATIVE_KERNELS=0\)"):
        LLM(batch_invariant=True)


def test_batch_invariant_must_be_a_bool():
    with pytest.raises(ValueError, match="batch_invariant must be True or False, got 'yes'"):
        LLM(batch_invariant="yes")


def test_sparse_attention_models_fail_at_start(tmp_path):
    """Checked from config.json, before any weight is read (there are none here)."""
    config = json.loads((default_model_dir() / "config.json").read_text())
    config.update(model_type="deepseek_v32", architectures=["DeepseekV32ForCausalLM"], index_topk=8, index_n_heads=4,
                  index_head_dim=32)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"batch_invariant=True cannot run with: DeepSeek Sparse Attention"):
        LLM(model=str(tmp_path), batch_invariant=True)
