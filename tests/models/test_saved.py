"""Saved quantized models: save -> load runs bit-identically to quantizing at load, maps the file instead of reading
or quantizing it, and refuses files it cannot run with a message saying what to do."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from latentserve import LLM, SamplingParams
from latentserve.cli import main
from latentserve.kernels.native import NATIVE_ENV
from latentserve.layers.quant import heads, int4, int8
from latentserve.layers.quant import linear as quant_linear
from latentserve.models import saved as saved_module
from latentserve.models.saved import MANIFEST, WEIGHTS, SavedModelError
from tests.checkpoints import make_checkpoint

ENGINE = dict(num_kv_blocks=64, block_size=4, num_threads=1)
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, prompt_logprobs=5)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    # Widths multiples of 32 (int4 groups); bf16 as DeepSeek's checkpoints.
    return make_checkpoint(tmp_path_factory.mktemp("saved"), "v3", dtype=torch.bfloat16, q_lora_rank=32,
                           moe_intermediate_size=32, intermediate_size=64)


def outputs(llm: LLM) -> list:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in llm.generate(PROMPTS, PARAMS)]


@pytest.fixture(scope="module", params=["int8", "int4"])
def saved(request, checkpoint, tmp_path_factory) -> tuple[str, Path, list]:
    """(method, saved folder, outputs of the model quantized at load)."""
    llm = LLM(checkpoint, quantization=request.param, dtype="bfloat16", **ENGINE)
    path = llm.save_quantized(tmp_path_factory.mktemp(request.param) / "model")
    return request.param, path, outputs(llm)


def forbid_quantizing(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a saved model was quantized again")

    for module, name in [(quant_linear, "quantize_int8"), (quant_linear, "quantize_int4"), (int8, "quantize_int8"),
                         (int4, "quantize_int4"), (heads, "quantize_int8"), (quant_linear, "quantize_linear")]:
        monkeypatch.setattr(module, name, refuse)


def test_saved_model_runs_bit_identically_without_quantizing(saved, monkeypatch):
    method, path, expected = saved
    forbid_quantizing(monkeypatch)
    llm = LLM(path, **ENGINE)
    assert llm.engine.quantization.method == method
    assert outputs(llm) == expected


def mapped_range(path: Path) -> list[tuple[int, int]]:
    """Address ranges where this process maps `path`."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(path.resolve())):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            ranges.append((start, end))
    return ranges


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_weights_are_views_of_the_mapped_file(saved):
    _, path, _ = saved
    llm = LLM(path, **ENGINE)
    ranges = mapped_range(path / WEIGHTS)
    assert ranges
    state = llm.engine.model.state_dict()
    assert len(state) > 20
    for t in state.values():
        assert any(start <= t.data_ptr() < end for start, end in ranges)
    with safe_open(path / WEIGHTS, "pt") as f:  # a valid safetensors file, by the format's own library
        names = [name for name in f.keys() if not name.startswith("__pad.")]
        assert set(state) - set(names) <= set(json.loads((path / MANIFEST).read_text())["aliases"])
        for name in names:
            if name in state:
                assert torch.equal(f.get_tensor(name), state[name]), name


def test_quantize_command(checkpoint, tmp_path, capsys):
    output = tmp_path / "int4"
    argv = ["quantize", "--model", str(checkpoint), "--quantization", "int4", "--dtype", "bfloat16"]
    assert main([*argv, "--output", str(output)]) == 0
    assert f"run it with --model {output}" in capsys.readouterr().out
    reference = LLM(checkpoint, quantization="int4", dtype="bfloat16", **ENGINE).generate(PROMPTS, PARAMS)
    mapped = LLM(output, **ENGINE).generate(PROMPTS, PARAMS)
    assert [o.outputs[0].logprobs for o in mapped] == [o.outputs[0].logprobs for o in reference]
    assert main([*argv, "--output", str(output)]) == 1
    assert "is not empty: pass a new --output folder" in capsys.readouterr().err


def test_embedded_model_saved_and_served_by_the_cli(tmp_path, capsys):
    """`latentserve quantize` then `generate --model DIR`: the same text as quantizing at load."""
    output = tmp_path / "embedded-int4"
    assert main(["quantize", "--quantization", "int4", "--output", str(output)]) == 0
    capsys.readouterr()
    flags = ["--max-tokens", "8", "--temperature", "0", "--num-kv-blocks", "64", "--json"]
    assert main(["generate", "--quantization", "int4", *flags]) == 0
    at_load = json.loads(capsys.readouterr().out)
    assert main(["generate", "--model", str(output), *flags]) == 0
    assert json.loads(capsys.readouterr().out) == at_load


def copy_saved(path: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in path.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    return copy


def edit_manifest(path: Path, **changes) -> None:
    manifest = json.loads((path / MANIFEST).read_text())
    manifest.update(changes)
    (path / MANIFEST).write_text(json.dumps(manifest))


def test_truncated_file_is_refused(saved, tmp_path):
    copy = copy_saved(saved[1], tmp_path)
    weights = copy / WEIGHTS
    os.truncate(weights, weights.stat().st_size - 100)
    with pytest.raises(SavedModelError, match="truncated .*save the model again"):
        LLM(copy, **ENGINE)


def test_newer_format_version_is_refused(saved, tmp_path):
    copy = copy_saved(saved[1], tmp_path)
    edit_manifest(copy, version=saved_module.VERSION + 1)
    with pytest.raises(SavedModelError, match="newer than this latentserve reads .*upgrade latentserve"):
        LLM(copy, **ENGINE)


def test_older_format_version_is_refused(saved, tmp_path):
    """Version 1 kept int8 weights in plain rows; this build reads only `pack_int8`'s blocks."""
    copy = copy_saved(saved[1], tmp_path)
    edit_manifest(copy, version=1)
    with pytest.raises(SavedModelError, match="version 1, whose packed weights this latentserve no longer reads .*"
                                              "quantize the original checkpoint again"):
        LLM(copy, **ENGINE)


def test_other_cpu_build_is_refused(saved, tmp_path):
    copy = copy_saved(saved[1], tmp_path)
    manifest = json.loads((copy / MANIFEST).read_text())
    other = "avx2" if manifest["layout"]["kernels"] != "avx2" else "avx512"
    edit_manifest(copy, layout={**manifest["layout"], "kernels": other})
    with pytest.raises(SavedModelError, match=f"saved for kernel layout .*{other}.*quantize the original checkpoint "
                                              "here"):
        LLM(copy, **ENGINE)


def test_a_model_on_pytorchs_int8_kernel_saves_and_needs_the_same_int_mm_parts(checkpoint, tmp_path, monkeypatch):
    """Without latentserve's kernels int8 layers run torch._int_mm; the saved weight is in the parts it takes here
    (two where it saturates), which the layout records."""
    monkeypatch.setenv(NATIVE_ENV, "0")
    llm = LLM(checkpoint, quantization="int8", dtype="bfloat16", **ENGINE)
    assert type(llm.engine.model.lm_head) is int8.IntMMInt8Linear
    path = llm.save_quantized(tmp_path / "model")
    parts = int8.int_mm_parts()
    assert json.loads((path / MANIFEST).read_text())["layout"] == {"kernels": None, "int_mm_parts": parts}
    assert outputs(LLM(path, **ENGINE)) == outputs(llm)
    monkeypatch.setattr(saved_module, "int_mm_parts", lambda: 3 - parts)
    with pytest.raises(SavedModelError, match=f"saved for kernel layout .*'int_mm_parts': {parts}"):
        LLM(path, **ENGINE)


def test_contradicting_settings_are_refused(saved):
    method, path, _ = saved
    other = "int8" if method == "int4" else "int4"
    with pytest.raises(SavedModelError, match=f"quantization={other} \\(saved: {method}\\)"):
        LLM(path, quantization=other, **ENGINE)
    with pytest.raises(SavedModelError, match="dtype=float32 \\(saved: bfloat16\\)"):
        LLM(path, dtype="float32", **ENGINE)
    with pytest.raises(ValueError, match="needs an MTP layer"):
        LLM(path, speculative_config={"method": "mtp", "num_speculative_tokens": 1}, **ENGINE)


def test_saving_needs_a_quantized_model(checkpoint, tmp_path):
    with pytest.raises(ValueError, match="save_quantized saves an int8 or int4 model"):
        LLM(checkpoint, **ENGINE).save_quantized(tmp_path / "plain")


@pytest.mark.skipif(quant_linear.default_policy().kernels is None, reason="latentserve's kernels do not build here")
def test_a_gguf_s_kept_blocks_save_and_run_bit_identically(tmp_path, monkeypatch):
    """A GGUF whose layers latentserve runs in the file's blocks (Q6_K, Q3_K, Q2_K, Q5_0, Q5_1, Q5_K, Q4_K) saves them
    as packed and runs the saved model as the file loaded."""
    from gguf import GGMLQuantizationType as T

    from latentserve.layers.quant.q45 import NativeQ4KLinear, NativeQ5KLinear, NativeQ50Linear, NativeQ51Linear
    from latentserve.layers.quant.q6k import NativeQ2KLinear, NativeQ3KLinear, NativeQ6KLinear
    from latentserve.models.formats import gguf as gguf_format
    from tests.models.gguf_checkpoint import write_gguf

    monkeypatch.setattr(gguf_format, "cache_root", lambda: tmp_path / "gguf-cache")
    src = make_checkpoint(tmp_path, "v3", hidden_size=256, intermediate_size=256, moe_intermediate_size=64,
                          q_lora_rank=256)
    kinds = {"attn_q_b.": T.Q5_K, "ffn_down_exps": T.Q5_0, "ffn_gate_exps": T.Q4_K, "ffn_up_exps": T.Q4_K,
             "ffn_down_shexp": T.Q5_1, "ffn_gate.": T.Q2_K, "ffn_up.": T.Q2_K, "attn_kv_a_mqa": T.Q3_K}
    write_gguf(src, tmp_path / "model.gguf", lambda name, t: T.Q6_K if name == "output.weight" else next(
        (k for p, k in kinds.items() if p in name), T.F32))
    llm = LLM(tmp_path / "model.gguf", dtype="float32", **ENGINE)
    model = llm.engine.model
    layer = model.model.layers[1]
    assert (type(layer.self_attn.q_b_proj), type(model.lm_head), type(layer.mlp.experts[0].down_proj),
            type(layer.mlp.experts[0].gate_up_proj), type(layer.mlp.shared_experts.down_proj)) == (
        NativeQ5KLinear, NativeQ6KLinear, NativeQ50Linear, NativeQ4KLinear, NativeQ51Linear)
    assert type(model.model.layers[0].mlp.gate_up_proj) is NativeQ2KLinear
    assert type(layer.self_attn.kv_a_proj_with_mqa) is NativeQ3KLinear
    expected = outputs(llm)
    path = llm.save_quantized(tmp_path / "saved")
    forbid_quantizing(monkeypatch)
    assert outputs(LLM(path, **ENGINE)) == expected
