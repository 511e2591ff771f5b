"""The step profile behind `latentserve bench --profile`: ops land in their category, the engine is left as it was."""
import json

import pytest

import torch
import torch.nn.functional as F

from latentserve import LLM, SamplingParams
from latentserve.cli import main
from latentserve.cli.step_profile import (
    ATTENTION, CATEGORIES, MOE, categorize, instrumented, new_profiler, step_range,
)
from latentserve.kernels.native import PROFILE_PREFIX
from latentserve.kernels.policy import default_policy
from latentserve.layers.moe import MoE
from tests.checkpoints import make_checkpoint


def test_categories_follow_scopes_and_gemms():
    x = torch.randn(64, 64)
    with new_profiler() as prof:
        with step_range("decode"):
            F.linear(x, x)  # a weight GEMM
            with torch.profiler.record_function(ATTENTION):
                torch.softmax(x @ x, dim=-1)  # a GEMM in attention is attention
            with torch.profiler.record_function(MOE):
                torch.topk(x, 4, dim=-1)  # routing
                F.linear(x, x)  # an expert's GEMM
            torch.tanh(x)
        torch.exp(x)  # outside any step: not counted
    events = prof.events()
    b = categorize(events)["decode"]
    assert b.num_steps == 1
    assert set(b.op_seconds) == set(CATEGORIES[:-1])

    def total(name):  # seconds of the top-level calls of op `name` (each wholly counted, children included)
        top = [e for e in events if e.name == name and (e.cpu_parent is None or e.cpu_parent.is_user_annotation)]
        return sum(e.cpu_time_total for e in top) * 1e-6

    assert abs(b.op_seconds["weight GEMMs"] - total("aten::linear")) < 1e-9
    assert abs(b.op_seconds["MoE routing + dispatch"] - total("aten::topk")) < 1e-9
    assert abs(b.op_seconds["other ops"] - total("aten::tanh")) < 1e-9
    assert abs(b.op_seconds["attention"] - total("aten::matmul") - total("aten::softmax")) < 1e-9


def test_profiling_an_engine_step_and_undoing_the_wrappers(tmp_path):
    llm = LLM(model=str(make_checkpoint(tmp_path, "v3")), block_size=4, num_kv_blocks=64)
    engine = llm.engine
    layer = next(iter(engine.model.static_forward_context.values()))
    moe = next(m for m in engine.model.modules() if isinstance(m, MoE))
    engine.add_request([5, 6, 7, 8, 9], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    with instrumented(engine), new_profiler() as prof:
        kinds = ["prefill", "decode", "decode"]
        for kind in kinds:
            with step_range(kind):
                engine.step()
    assert not engine.has_unfinished_requests()
    assert "forward" not in vars(layer.decode_backend) and "forward" not in vars(moe)
    result = categorize(prof.events())
    assert result["decode"].num_steps == 2 and result["prefill"].num_steps == 1
    for kind in ("prefill", "decode"):
        for category in ("weight GEMMs", "attention"):
            assert result[kind].op_seconds[category] > 0, (kind, category)
    # The prefill routes in torch ops; a decode step's MoE block is one native call, counted with the weight GEMMs
    # (where the engine has latentserve's kernels).
    assert result["prefill"].op_seconds["MoE routing + dispatch"] > 0
    native_moe = any(e.name == PROFILE_PREFIX + "ls_moe_block" for e in prof.events())
    assert native_moe == (default_policy().kernels is not None)


def test_bench_profile_prints_the_breakdown(tmp_path, capsys):
    model = make_checkpoint(tmp_path, "v3")
    out_json = tmp_path / "bench.json"
    code = main(["bench", "--model", str(model), "--num-prompts", "2", "--input-len", "6", "--output-len", "3",
                 "--profile", "--output-json", str(out_json), "--block-size", "4", "--num-kv-blocks", "64"])
    out = capsys.readouterr().out
    assert code == 0
    assert "decode steps" in out and all(c in out for c in CATEGORIES)
    profile = json.loads(out_json.read_text())["profile_ms_per_step"]
    assert set(profile["decode"]) == set(CATEGORIES)


@pytest.mark.parametrize("fused", [False, True], ids=["modules", "fused block"])
def test_native_quantized_kernels_count_as_weight_gemms(tmp_path, monkeypatch, fused):
    """latentserve's own kernels are ctypes calls, invisible to torch's profiler but for the range each records: the
    linears' count as weight GEMMs, the decode attention's as attention; the one-call attention block (run here
    with the modules' kernels, then without) as weight GEMMs, its attention share included."""
    from latentserve.kernels.cpu import cpu_features
    from latentserve.kernels.native import native_kernels
    from latentserve.models import deepseek

    if native_kernels(cpu_features())[0] is None:
        return  # PyTorch's kernels here: the tests above cover them
    if not fused:
        monkeypatch.setattr(deepseek, "fused_attention", lambda *a: None)
        monkeypatch.setattr(deepseek, "layer_run", lambda *a: None)
    checkpoint = make_checkpoint(tmp_path, "v3", q_lora_rank=32, moe_intermediate_size=32, intermediate_size=64,
                                 kv_lora_rank=32, v_head_dim=16)
    engine = LLM(model=str(checkpoint), block_size=4, num_kv_blocks=64, quantization="int8").engine
    engine.add_request([5, 6, 7, 8, 9], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    engine.step()  # the prompt
    with instrumented(engine), new_profiler() as prof:
        with step_range("decode"):
            engine.step()
    natives = [e for e in prof.events() if e.name.startswith("latentserve::")]
    gemms = [e for e in natives if e.name != "latentserve::ls_mla_decode"]  # that one is the decode attention
    assert gemms and (len(gemms) == len(natives)) == fused
    # (one token: the decode run's one call, every layer's blocks in it)
    assert any(e.name in ("latentserve::ls_mla_attention_block", "latentserve::ls_decode_layers")
               for e in natives) == fused
    result = categorize(prof.events())["decode"]
    for category, events in (("weight GEMMs", gemms), ("attention", [e for e in natives if e not in gemms])):
        assert result.op_seconds[category] >= sum(e.cpu_time_total for e in events) * 1e-6 * 0.99
