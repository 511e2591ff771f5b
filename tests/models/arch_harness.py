"""The shared checks of every MLA architecture (tests/models/test_arch_*.py): a tiny random model shaped like the real
one, written by transformers' `save_pretrained`, loaded by latentserve and compared with transformers' own model
(fp32, eager attention) as the oracle.

A test file declares its `ArchCase` and subclasses `ArchSuite`:

    class TestSarvam(ArchSuite):
        case = ArchCase("sarvam_mla", dict(q_lora_rank=None, ...))
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from latentserve import LLM, SamplingParams
from latentserve.kernels import native
from latentserve.kernels.policy import default_policy
from latentserve.models import deepseek

PROMPTS = [[5, 17, 33, 2, 9, 41, 77, 12, 60], [3, 88], list(range(10, 40)), [70, 71, 72, 73, 74]]
MAX_TOKENS = 12
ATOL = 1e-4

# Widths the fast paths take (the per-head kernel's multiples of 16, int4's 32-column groups) and weights large enough
# that routing and attention matter; each case overrides what its model does differently.
BASE = dict(
    vocab_size=96, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
    v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, max_position_embeddings=256,
    initializer_range=0.1, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=None,
)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, beta_fast=32,
            beta_slow=1, mscale=1.0, mscale_all_dim=1.0)


@dataclass(frozen=True)
class ArchCase:
    model_type: str
    config: dict  # transformers config fields over BASE
    drop: tuple[str, ...] = ()  # BASE fields the model's config does not take
    native_attention: bool = True  # a decode layer's attention runs attention_block.c
    native_moe: bool = True  # a decode layer's MoE runs moe_block.c
    int4_error: float = 0.5  # mean |prompt log-prob error| of int4 weights against fp32 (int8: a quarter)
    model_class: str = "AutoModelForCausalLM"  # transformers' class, where the auto class does not map the type

    def transformers_config(self):
        from transformers import AutoConfig

        fields = {k: v for k, v in {**BASE, **self.config}.items() if k not in self.drop}
        config = AutoConfig.for_model(self.model_type, **fields)
        config._attn_implementation = "eager"
        return config

    def model_cls(self):
        import transformers

        return getattr(transformers, self.model_class)

    def reference(self, path: Path):
        """transformers' model of a saved checkpoint: the numerical oracle, fp32 with eager attention."""
        return self.model_cls().from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def make_arch_checkpoint(root: Path, case: ArchCase, seed: int = 0) -> Path:
    """A random tiny model of the case, saved by transformers; norms, biases and the correction bias randomized too
    (transformers initializes them to constants)."""
    torch.manual_seed(seed)
    config = case.transformers_config()
    model = (case.model_cls().from_config(config) if case.model_class == "AutoModelForCausalLM"
             else case.model_cls()(config)).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("norm.weight"):
                tensor.uniform_(0.5, 1.5, generator=g)
            elif name.endswith("e_score_correction_bias") or name.endswith(".bias"):
                tensor.normal_(0.0, 0.1, generator=g)
    path = Path(root) / f"{case.model_type}-{seed}"
    model.save_pretrained(path)
    return path


def llm(path: Path, **kwargs) -> LLM:
    # fp32: compared with transformers' fp32 at fp32 round-off (dtype="auto" may be bf16).
    defaults = dict(dtype="float32", block_size=4, num_kv_blocks=128, max_num_batched_tokens=256)
    return LLM(model=str(path), **{**defaults, **kwargs})


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0, prompt_logprobs=0)


def prompt_logprobs(out) -> list[float]:
    return [out.prompt_logprobs[pos][out.prompt_token_ids[pos]].logprob for pos in range(1, len(out.prompt_token_ids))]


def output_logprobs(out) -> torch.Tensor:
    """The log-prob of each generated token."""
    completion = out.outputs[0]
    return torch.tensor([lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)])


class ArchSuite:
    case: ArchCase

    @pytest.fixture(scope="class")
    @classmethod
    def checkpoint(cls, tmp_path_factory) -> Path:
        return make_arch_checkpoint(tmp_path_factory.mktemp(cls.case.model_type), cls.case)

    @pytest.fixture(scope="class")
    @classmethod
    def greedy(cls, checkpoint):
        return llm(checkpoint).generate(PROMPTS, GREEDY)

    def test_config_is_this_architecture(self, checkpoint) -> None:
        model = llm(checkpoint).engine.runner.model
        assert model.config.model_type == self.case.model_type

    def test_prompt_logprobs_match_transformers(self, checkpoint, greedy) -> None:
        reference = self.case.reference(checkpoint)
        for prompt, out in zip(PROMPTS, greedy):
            with torch.no_grad():
                expected = reference(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
            assert expected.std(-1).min() > 0.3  # a near-uniform oracle would let any model match
            want = [expected[pos - 1, prompt[pos]].item() for pos in range(1, len(prompt))]
            torch.testing.assert_close(torch.tensor(prompt_logprobs(out)), torch.tensor(want), rtol=0, atol=ATOL)

    def test_greedy_tokens_and_logprobs_teacher_forced(self, checkpoint, greedy) -> None:
        """transformers over prompt + our output picks each of our tokens and gives it our log-prob."""
        reference = self.case.reference(checkpoint)
        for prompt, out in zip(PROMPTS, greedy):
            tokens = out.outputs[0].token_ids
            assert len(tokens) == MAX_TOKENS
            with torch.no_grad():
                expected = reference(torch.tensor([prompt + tokens])).logits[0].float().log_softmax(-1)
            steps = expected[len(prompt) - 1 : -1]
            assert steps.argmax(-1).tolist() == tokens
            want = steps.gather(1, torch.tensor(tokens)[:, None])[:, 0]
            torch.testing.assert_close(output_logprobs(out), want, rtol=0, atol=ATOL)

    def test_dbo_equals_no_dbo(self, checkpoint, greedy) -> None:
        split = llm(checkpoint, enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=2)
        outputs = split.generate(PROMPTS, GREEDY)
        for a, b in zip(greedy, outputs):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            torch.testing.assert_close(torch.tensor(prompt_logprobs(b)), torch.tensor(prompt_logprobs(a)),
                                       rtol=0, atol=1e-5)

    @pytest.mark.skipif(default_policy().kernels is None, reason="batch-invariant mode runs latentserve's kernels")
    def test_batch_invariant_mode(self, checkpoint) -> None:
        """batch_invariant=True: a request alone and among others (its prefill chunked beside theirs) gives the same
        tokens and log-probs, to the bit."""
        engine = llm(checkpoint, batch_invariant=True, max_num_batched_tokens=48, num_kv_blocks=256)
        alone = engine.generate(PROMPTS[:1], GREEDY)[0]
        batched = engine.generate(PROMPTS + [list(range(50, 90))], GREEDY)[0]
        assert alone.outputs[0].token_ids == batched.outputs[0].token_ids
        assert torch.equal(output_logprobs(alone), output_logprobs(batched))

    @pytest.mark.parametrize("method", ["int8", "int4", "bfloat16"])
    def test_quantized_loading_stays_close(self, checkpoint, greedy, method: str) -> None:
        """Quantized weights, or bf16 compute, move the prompt log-probs a little on average (int4 the most)."""
        params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0)
        settings = dict(dtype="bfloat16") if method == "bfloat16" else dict(quantization=method)
        outputs = llm(checkpoint, **settings).generate(PROMPTS, params)
        full = torch.tensor([lp for out in greedy for lp in prompt_logprobs(out)])
        quantized = torch.tensor([lp for out in outputs for lp in prompt_logprobs(out)])
        error = (quantized - full).abs().mean().item()
        assert 0 < error <= self.case.int4_error / (1 if method == "int4" else 4), error

    @pytest.mark.skipif(default_policy().kernels is None, reason="latentserve's kernels do not build here")
    def test_decode_fast_path(self, checkpoint, greedy, monkeypatch) -> None:
        """The one-call attention and MoE blocks run a decode step where the layers are of a kind they take (and
        give the modules' tokens), and decline the others."""
        calls = {"attention": 0, "moe": 0}

        def spy(kind, real):
            def wrapped(*args):
                calls[kind] += 1
                return real(*args)
            return wrapped

        monkeypatch.setattr(native, "mla_attention_block", spy("attention", native.mla_attention_block))
        monkeypatch.setattr(native, "moe_block", spy("moe", native.moe_block))
        # the decode run chains both blocks of its layers (models/decode_layers.py)
        monkeypatch.setattr(native, "decode_layers", spy("attention", spy("moe", native.decode_layers)))
        fused = llm(checkpoint).generate(PROMPTS[:2], GREEDY)  # decode steps of two tokens: few enough
        assert (calls["attention"] > 0) == self.case.native_attention
        assert (calls["moe"] > 0) == self.case.native_moe
        for a, b in zip(greedy, fused):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
        monkeypatch.setattr(deepseek, "fused_attention", lambda *a: None)
        monkeypatch.setattr(deepseek, "fused_moe", lambda *a: None)
        monkeypatch.setattr(deepseek, "layer_run", lambda *a: None)
        modules = llm(checkpoint).generate(PROMPTS[:2], GREEDY)
        for a, b in zip(fused, modules):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            torch.testing.assert_close(output_logprobs(a), output_logprobs(b), rtol=0, atol=1e-5)
