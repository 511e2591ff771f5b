"""Kimi-Linear (kimi_linear) against transformers: KDA layers over per-request states, MLA without rope, V3 MoE; and the
engine's handling of those states (chunked prefill, several requests, DBO, preemption, prefix caching refused)."""
import pytest
import torch

from latentserve import SamplingParams
from latentserve.models import ModelConfig
from tests.checkpoints import load_reference
from tests.models.arch_harness import GREEDY, MAX_TOKENS, PROMPTS, ArchCase, ArchSuite, llm, prompt_logprobs

# The real model's pattern: three KDA layers to one MLA layer, the first layer dense, no q LoRA.
KDA = dict(head_dim=32, num_heads=2, short_conv_kernel_size=4, full_attn_layers=[4], kda_layers=[1, 2, 3])


class TestKimiLinear(ArchSuite):
    case = ArchCase("kimi_linear", dict(num_hidden_layers=4, q_lora_rank=None, linear_attn_config=KDA,
                                        num_local_experts=8, n_group=1, topk_group=1, first_k_dense_replace=1),
                    drop=("n_routed_experts",))

    def test_batch_invariant_mode(self, checkpoint) -> None:
        """Not yet checked to the bit: batch-invariant mode refuses the linear-attention layers, naming them."""
        with pytest.raises(ValueError, match="linear-attention layers"):
            llm(checkpoint, batch_invariant=True)

    def test_layer_pattern(self, checkpoint) -> None:
        model = llm(checkpoint).engine.runner.model
        assert model.config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
        assert list(model.state_layers) == [f"model.layers.{i}.self_attn" for i in range(3)]
        assert model.attention_layer_names == ["model.layers.3.self_attn.attn"]

    def test_kv_memory_holds_blocks_of_the_mla_layers_only(self, checkpoint) -> None:
        per_block = 4 * (32 + 16) * 4  # block_size 4, one MLA layer's latent + rope key, fp32
        engine = llm(checkpoint, num_kv_blocks=None, kv_cache_memory_bytes=100 * per_block)
        assert engine.engine.scheduler.block_manager.num_blocks == 100

    def test_decode_matches_transformers_generate(self, checkpoint, greedy) -> None:
        """transformers' own cached decode (its conv and recurrent states) continues the prompts as ours does."""
        reference = load_reference(checkpoint)
        reference.generation_config.eos_token_id = None  # ours ran past EOS (ignore_eos)
        for prompt, out in zip(PROMPTS, greedy):
            expected = reference.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
            assert out.outputs[0].token_ids == expected[0, len(prompt):].tolist()

    @pytest.mark.parametrize("mode", ["chunked_prefill", "one_by_one", "preemption", "dbo_chunked_preempt"])
    def test_engine_modes_equal_one_batch(self, checkpoint, greedy, mode: str) -> None:
        """The state carries over prefill chunks, each request has its own, preemption restarts it from zero, and
        DBO's ubatches own disjoint slots: every mode gives the tokens and log-probs of one plain batch."""
        small_pool = dict(num_kv_blocks=14, max_model_len=48)  # one request fits, all of them at once do not
        kwargs = {
            "chunked_prefill": dict(max_num_batched_tokens=8),
            "one_by_one": {},
            "preemption": small_pool,
            "dbo_chunked_preempt": dict(enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=2,
                                        max_num_batched_tokens=16, **small_pool),
        }[mode]
        engine = llm(checkpoint, **kwargs)
        preempted = []
        original = engine.engine.scheduler._preempt
        engine.engine.scheduler._preempt = lambda request: (preempted.append(request.request_id), original(request))
        splits = []
        slicer = engine.engine.runner._ubatch_slices
        engine.engine.runner._ubatch_slices = lambda common: splits.append(slicer(common)) or splits[-1]
        if mode == "one_by_one":
            outputs = [engine.generate([p], GREEDY)[0] for p in PROMPTS]
        else:
            outputs = engine.generate(PROMPTS, GREEDY)
        assert bool(preempted) == ("preempt" in mode)
        split = [s for s in splits if s is not None]
        assert bool(split) == mode.startswith("dbo")
        # Two ubatches never share a request, hence a state slot.
        assert all(s0.request_slice.stop <= s1.request_slice.start for s0, s1 in split)
        for a, b in zip(greedy, outputs):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            torch.testing.assert_close(torch.tensor(prompt_logprobs(b)), torch.tensor(prompt_logprobs(a)),
                                       rtol=0, atol=1e-5)
        pool = engine.engine.scheduler.block_manager.state_pool
        assert pool.num_free_slots == pool.num_slots  # every finished request gave its slot back

    def test_parallel_samples_each_compute_their_prompt(self, checkpoint, greedy) -> None:
        """n > 1: the samples share no blocks (a state is not a prefix of blocks), and each matches the single run."""
        out = llm(checkpoint).generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, n=2,
                                                                   ignore_eos=True))
        assert [c.token_ids for c in out[0].outputs] == [greedy[0].outputs[0].token_ids] * 2

    def test_prefix_caching_is_refused(self, checkpoint) -> None:
        with pytest.raises(ValueError, match="enable_prefix_caching=True: kimi_linear has linear-attention layers"):
            llm(checkpoint, enable_prefix_caching=True)
        assert not llm(checkpoint).engine.scheduler.block_manager.enable_prefix_caching

    def test_saved_int8_model_runs_as_quantized_at_load(self, checkpoint, tmp_path) -> None:
        """The KDA layers' quantized projections and fp32 parameters survive save_quantized, to the bit."""
        at_load = llm(checkpoint, quantization="int8")
        at_load.save_quantized(tmp_path / "int8")
        saved = llm(tmp_path / "int8", dtype="auto")  # the saved manifest names the dtype
        for a, b in zip(at_load.generate(PROMPTS, GREEDY), saved.generate(PROMPTS, GREEDY)):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert a.outputs[0].logprobs == b.outputs[0].logprobs

    def test_batch_invariant_mode_is_refused(self, checkpoint) -> None:
        refused = "batch_invariant=True cannot run with: (.*; )?kimi_linear's linear-attention"  # after the kernels'
        with pytest.raises(ValueError, match=refused):
            llm(checkpoint, batch_invariant=True)

    def test_max_num_seqs_bounds_the_state_pool(self, checkpoint, greedy) -> None:
        engine = llm(checkpoint, max_num_seqs=2)
        pool = engine.engine.scheduler.block_manager.state_pool
        state = engine.engine.runner.model.state_layers["model.layers.0.self_attn"].recurrent_state
        assert pool.num_slots == 2 and state.shape[0] == 2
        outputs = engine.generate(PROMPTS, GREEDY)  # four requests through two slots, each from a zero state
        assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in greedy]


def _raw_config(**over) -> dict:
    raw = TestKimiLinear.case.transformers_config().to_dict() | {"architectures": ["KimiLinearForCausalLM"]}
    return raw | over


def test_config_reads_the_checkpoint_spellings() -> None:
    raw = _raw_config()
    del raw["layer_types"]  # from linear_attn_config's 1-based layer lists
    config = ModelConfig.from_dict(raw)
    assert config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert config.routing.n_routed_experts == 8 and config.routing.num_experts_per_tok == 2
    assert config.rope_free and config.linear_attention.head_dim == 32
    assert [config.is_moe_layer(i) for i in range(4)] == [False, True, True, True]


@pytest.mark.parametrize("layer_types", [["full_attention"] * 3, ["linear_attention"] * 3 + ["mamba"]])
def test_bad_layer_types_are_refused(layer_types) -> None:
    with pytest.raises(ValueError, match="'layer_types' must give one of"):
        ModelConfig.from_dict(_raw_config(layer_types=layer_types))
