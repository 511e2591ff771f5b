"""Accuracy of each weight format on real weights (the embedded model): teacher-forced top-1 agreement with the fp32
engine and perplexity on held-out text, against the issue's targets."""
from __future__ import annotations

import math

import pytest

from latentserve import LLM, SamplingParams

# Genesis 1:1-13 (KJV): the first chapter is held out of the embedded model's training (every 50th chapter is).
HELD_OUT = """In the beginning God created the heaven and the earth.
And the earth was without form, and void; and darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters.
And God said, Let there be light: and there was light.
And God saw the light, that it was good: and God divided the light from the darkness.
And God called the light Day, and the darkness he called Night. And the evening and the morning were the first day.
And God said, Let there be a firmament in the midst of the waters, and let it divide the waters from the waters.
And God made the firmament, and divided the waters which were under the firmament from the waters which were above the firmament: and it was so.
And God called the firmament Heaven. And the evening and the morning were the second day.
And God said, Let the waters under the heaven be gathered together unto one place, and let the dry land appear: and it was so.
And God called the dry land Earth; and the gathering together of the waters called he Seas: and God saw that it was good.
And God said, Let the earth bring forth grass, the herb yielding seed, and the fruit tree yielding fruit after his kind, whose seed is in itself, upon the earth: and it was so.
And the earth brought forth grass, and herb yielding seed after his kind, and the tree yielding fruit, whose seed was in itself, after his kind: and God saw that it was good.
And the evening and the morning were the third day."""

# format -> (LLM settings, perplexity at most this times fp32's, top-1 agreement with fp32 at least)
FORMATS = {
    "bf16": (dict(dtype="bfloat16"), 1.005, 0.97),
    "int8": (dict(quantization="int8"), 1.01, 0.93),  # dtype "auto": bf16 activations where the CPU has bf16
    "int4": (dict(quantization="int4"), 1.10, 0.90),  # per layer: groups of 128 where they divide
    "int4-g64": (dict(quantization="int4", quantization_group_size=64), 1.10, 0.90),
    "int4-g32": (dict(quantization="int4", quantization_group_size=32), 1.10, 0.90),
}
PARAMS = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)


def _score(chunk: int = 512, **settings) -> tuple[float, list[int]]:
    """(perplexity of the held-out text, the top-1 prediction at each position), teacher-forced in prefill chunks of
    `chunk` tokens: 512 runs the quantized layers' many-row kernels, 16 their few-row (decode) ones."""
    llm = LLM(max_num_seqs=1, num_kv_blocks=64, max_num_batched_tokens=chunk, **settings)
    out = llm.generate([HELD_OUT], PARAMS)[0]
    positions = out.prompt_logprobs[1:]
    targets = out.prompt_token_ids[1:]
    nll = -sum(p[t].logprob for p, t in zip(positions, targets)) / len(targets)
    return math.exp(nll), [max(p, key=lambda t: p[t].logprob) for p in positions]


@pytest.fixture(scope="module")
def fp32():
    return _score(dtype="float32")


@pytest.mark.parametrize("chunk", [512, 16])
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_format_keeps_perplexity_and_top1(fp32, name, chunk):
    settings, max_ratio, min_agreement = FORMATS[name]
    fp32_ppl, fp32_top1 = fp32
    ppl, top1 = _score(chunk, **settings)
    agreement = sum(a == b for a, b in zip(top1, fp32_top1)) / len(top1)
    summary = f"{name}: perplexity {ppl:.3f} vs fp32 {fp32_ppl:.3f} ({ppl / fp32_ppl:.4f}x), top-1 {agreement:.3f}"
    assert len(top1) > 250
    assert ppl <= max_ratio * fp32_ppl, summary
    assert agreement >= min_agreement, summary
