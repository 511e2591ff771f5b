"""Every sampling parameter through `LLM.generate`, judged by teacher forcing on transformers' logits and a
naive per-request rendering of vLLM's processing (so the engine must hand each row its own history)."""
from __future__ import annotations

import random

import pytest
import torch

from latentserve import LLM, SamplingParams
from latentserve.engine.detokenizer import bad_words_token_ids
from tests.checkpoints import load_reference, make_checkpoint
from tests.engine.test_logits_processors import reference_min_p_keep, reference_row

PROMPTS = [[5, 17, 33, 2, 9, 41, 77, 12, 60], [3, 88, 3, 88, 3], list(range(10, 30)), [70, 71, 72, 73, 74, 70]]
TIE = 1e-3  # teacher forcing allows near-ties between the engine's and transformers' round-off


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("ckpt"), "v3")
    return path, load_reference(path)


def _cases(vocab_size: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(0)
    greedy = dict(temperature=0.0, max_tokens=10, ignore_eos=True)
    return [
        (PROMPTS[0], SamplingParams(repetition_penalty=1.8, frequency_penalty=0.7, presence_penalty=0.5, **greedy)),
        (PROMPTS[1], SamplingParams(repetition_penalty=0.6, presence_penalty=-1.0, **greedy)),
        (PROMPTS[2], SamplingParams(logit_bias={rng.randrange(vocab_size): rng.uniform(-100, 100) for _ in range(20)},
                                    frequency_penalty=1.5, **greedy)),
        (PROMPTS[3], SamplingParams(allowed_token_ids=rng.sample(range(vocab_size), 6), repetition_penalty=1.3,
                                    **greedy)),
        (PROMPTS[0], SamplingParams(min_tokens=6, stop_token_ids=rng.sample(range(vocab_size), 30), temperature=0.0,
                                    max_tokens=10)),
        (PROMPTS[2], SamplingParams(truncate_prompt_tokens=5, presence_penalty=2.0, **greedy)),
        (PROMPTS[1], SamplingParams(temperature=0.9, min_p=0.3, seed=11, frequency_penalty=0.4, max_tokens=10,
                                    ignore_eos=True)),
    ]


def _check_against_reference(ref, prompt, params, out):
    prompt = prompt[-params.truncate_prompt_tokens:] if params.truncate_prompt_tokens else prompt
    assert out.prompt_token_ids == prompt
    tokens = out.outputs[0].token_ids
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + tokens])).logits[0].float()
    for i, token in enumerate(tokens):
        banned = params.stop_token_ids if i < params.min_tokens else []
        expected = reference_row(logits[len(prompt) - 1 + i].tolist(), params, prompt, tokens[:i], [], banned)
        if params.is_greedy:
            assert expected[token] >= max(expected) - TIE, (params, i)
        else:
            assert token in reference_min_p_keep(expected, params.temperature, params.min_p), (params, i)


@pytest.mark.parametrize("mode", ["plain", "dbo_chunked_preempt"])
def test_each_parameter_matches_the_naive_reference(setup, mode):
    path, ref = setup
    kwargs = dict(dtype="float32", block_size=4, num_kv_blocks=128, max_num_batched_tokens=256)
    if mode != "plain":
        kwargs.update(num_kv_blocks=12, max_model_len=48, max_num_batched_tokens=16, enable_dbo=True,
                      dbo_decode_token_threshold=2, dbo_prefill_token_threshold=2)
    llm = LLM(model=str(path), **kwargs)
    cases = _cases(ref.config.vocab_size)
    outputs = llm.generate([p for p, _ in cases], [sp for _, sp in cases])
    for (prompt, params), out in zip(cases, outputs):
        _check_against_reference(ref, prompt, params, out)
    # Each case changes the output against plain greedy sampling (the parameter is not ignored).
    plain = llm.generate([p for p, _ in cases[:6]], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert all(a.outputs[0].token_ids != b.outputs[0].token_ids for a, b in zip(plain, outputs))


def test_out_of_vocabulary_ids_are_refused_by_name(setup):
    path, ref = setup
    llm = LLM(model=str(path), block_size=4, num_kv_blocks=64)
    vocab = ref.config.vocab_size
    for kwargs, field in [({"logit_bias": {vocab: 5.0}}, "logit_bias"), ({"allowed_token_ids": [1, vocab]}, "allowed_token_ids"),
                          ({"stop_token_ids": [vocab + 1]}, "stop_token_ids")]:
        with pytest.raises(ValueError, match=f"{field} has token ids"):
            llm.generate([[1, 2, 3]], SamplingParams(**kwargs))
    with pytest.raises(ValueError, match="bad_words needs a tokenizer"):
        llm.generate([[1, 2, 3]], SamplingParams(bad_words=["x"]))


def test_bad_words_and_stop_strings_on_the_embedded_model():
    llm = LLM(max_num_seqs=4, num_kv_blocks=64)
    tokenizer = llm.get_tokenizer()
    prompt = "And God said"
    greedy = dict(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = llm.generate([prompt], SamplingParams(**greedy))[0].outputs[0]

    def occurs(ids, tokens):
        return any(tokens[i:i + len(ids)] == ids for i in range(len(tokens)))

    # A word of the output that the bad-words tokenization (vLLM's) finds there.
    candidates = [(w, bad_words_token_ids(tokenizer, [w])) for w in plain.text.split()[1:]]
    word, sequences = next((w, seqs) for w, seqs in candidates if any(occurs(ids, plain.token_ids) for ids in seqs))
    banned = llm.generate([prompt], SamplingParams(bad_words=[word], **greedy))[0].outputs[0]
    assert banned.token_ids != plain.token_ids
    assert not any(occurs(ids, banned.token_ids) for ids in sequences)
    # include_stop_str_in_output keeps the stop string (and a stop token's text) in the output.
    stop = plain.text.split()[2]
    cut, kept = (llm.generate([prompt], SamplingParams(stop=[stop], include_stop_str_in_output=keep, **greedy))[0].outputs[0]
                 for keep in (False, True))
    assert cut.stop_reason == kept.stop_reason == stop and kept.text == cut.text + stop
    assert plain.text.startswith(kept.text)
    stop_at = plain.token_ids[3]
    for keep in (False, True):
        out = llm.generate([prompt], SamplingParams(stop_token_ids=[stop_at], include_stop_str_in_output=keep,
                                                    skip_special_tokens=False, **greedy))[0].outputs[0]
        assert out.stop_reason == stop_at and out.token_ids == plain.token_ids[:4]
        assert out.text == tokenizer.decode(out.token_ids if keep else out.token_ids[:-1], skip_special_tokens=False)
