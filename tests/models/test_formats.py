"""Weight formats through the loader: a DeepSeek FP8 checkpoint, int8 and int4 at load, against transformers on the
same weights dequantized into a plain checkpoint."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from latentserve.config import AttentionConfig
from latentserve.layers.linear import Linear
from latentserve.layers.quant import linear as quant_linear
from latentserve.layers.quant.config import QuantConfig
from latentserve.kernels.cpu import cpu_features
from latentserve.kernels.policy import KernelPolicy, default_policy
from latentserve.layers.quant.int4 import Int4Linear, quantize_int4
from latentserve.layers.quant.int8 import Int8Linear, quantize_int8
from latentserve.kernels.native import NATIVE_ENV
from latentserve.models import load_model, loader
from latentserve.models.loader import SINGLE_FILE
from tests.checkpoints import load_reference, make_checkpoint
from tests.models.paged import PagedRunner

FP8_MAX = 448.0  # float8_e4m3fn
# The weights DeepSeek's FP8 checkpoints store in FP8: attention projections and every MLP / expert projection.
FP8_WEIGHT = re.compile(r"\.(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|gate_proj|up_proj|"
                        r"down_proj)\.weight$")
PROMPTS = [[5, 17, 33, 2, 9], [3, 88, 41, 7, 60, 12, 1, 90, 44], [70, 71, 72]]
ATTN = AttentionConfig(block_size=4)
# int4 groups of 32 must divide every quantized layer's input.
INT4_SHAPES = dict(q_lora_rank=32, moe_intermediate_size=32, intermediate_size=64)


def _blocks(rows: int, cols: int, block: tuple[int, int]):
    for i in range(0, rows, block[0]):
        for j in range(0, cols, block[1]):
            yield i // block[0], j // block[1], slice(i, i + block[0]), slice(j, j + block[1])


def _write_fp8(src: Path, dst: Path, block: tuple[int, int]) -> Path:
    """`src` as DeepSeek publishes FP8: one float32 scale per block (amax / 448), float8_e4m3fn weights."""
    tensors = {}
    for name, w in load_file(src / SINGLE_FILE).items():
        if not FP8_WEIGHT.search(name):
            tensors[name] = w
            continue
        rows, cols = w.shape
        scale = torch.empty(-(-rows // block[0]), -(-cols // block[1]))
        q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
        for bi, bj, r, c in _blocks(rows, cols, block):
            scale[bi, bj] = w[r, c].abs().max() / FP8_MAX
            q[r, c] = (w[r, c] / scale[bi, bj]).to(torch.float8_e4m3fn)
        tensors[name], tensors[name + "_scale_inv"] = q, scale
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                         weight_block_size=list(block))
    (dst / "config.json").write_text(json.dumps(config))
    save_file(tensors, dst / SINGLE_FILE, metadata={"format": "pt"})
    return dst


def _write_plain(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config))
    save_file(tensors, dst / SINGLE_FILE, metadata={"format": "pt"})
    return dst


def _dequantized_fp8(fp8: Path, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Every FP8 weight times its block's scale, block by block."""
    stored = load_file(fp8 / SINGLE_FILE)
    tensors = {}
    for name, t in stored.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            w, scale = torch.empty(t.shape), stored[name + "_scale_inv"]
            for bi, bj, r, c in _blocks(*t.shape, block):
                w[r, c] = t[r, c].float() * scale[bi, bj]
            t = w
        tensors[name] = t
    return tensors


def _logprobs(model, prompts=PROMPTS) -> list[torch.Tensor]:
    logits = PagedRunner(model, ATTN).step(list(enumerate(prompts)))
    return [x.log_softmax(-1) for x in logits.split([len(p) for p in prompts])]


def _reference(path: Path, prompts=PROMPTS) -> list[torch.Tensor]:
    reference = load_reference(path)
    with torch.no_grad():
        return [reference(torch.tensor([p])).logits[0].float().log_softmax(-1) for p in prompts]


@pytest.mark.parametrize("variant, block", [("v3", (16, 16)), ("v2_lite", (16, 8))])
def test_fp8_checkpoint_matches_transformers_on_the_dequantized_weights(tmp_path, variant, block):
    src = make_checkpoint(tmp_path, variant)
    fp8 = _write_fp8(src, tmp_path / "fp8", block)
    plain = _write_plain(src, tmp_path / "plain", _dequantized_fp8(fp8, block))
    model = load_model(fp8, dtype=torch.float32, attn_config=ATTN)
    expected = load_model(plain, dtype=torch.float32, attn_config=ATTN).state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name  # the published dequantization, bit for bit
    for ours, theirs in zip(_logprobs(model), _reference(plain)):
        assert theirs.std(-1).min() > 0.3
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


def test_fp8_checkpoint_errors_name_the_tensor(tmp_path):
    src = make_checkpoint(tmp_path, "v3_nonorm")
    fp8 = _write_fp8(src, tmp_path / "fp8", (16, 16))
    tensors = load_file(fp8 / SINGLE_FILE)
    name = "model.layers.0.self_attn.o_proj.weight"
    scale = tensors.pop(name + "_scale_inv")
    save_file(tensors, fp8 / SINGLE_FILE)
    with pytest.raises(ValueError, match=f"FP8 tensor '{name}' has no '{name}_scale_inv'"):
        load_model(fp8)
    tensors[name + "_scale_inv"] = scale[:1]
    save_file(tensors, fp8 / SINGLE_FILE)
    with pytest.raises(ValueError, match=rf"{name}_scale_inv has shape \(1, 2\); weight \(32, 32\) in blocks of "
                                         rf"\(16, 16\) needs \(2, 2\)"):
        load_model(fp8)
    (fp8 / "config.json").write_text((src / "config.json").read_text())  # FP8 tensors, no quantization_config
    with pytest.raises(ValueError, match="an FP8 block scale, but config.json has no quantization_config"):
        load_model(fp8)
    save_file({n: t for n, t in tensors.items() if not n.endswith("_scale_inv")}, fp8 / SINGLE_FILE)
    with pytest.raises(ValueError, match="float8_e4m3fn; supported: fp32, bf16, fp16 .FP8 weights need"):
        load_model(fp8)


def _quantized_reference(src: Path, dst: Path, config: QuantConfig) -> Path:
    """A plain fp32 checkpoint holding each quantizable weight as int8/int4 quantization leaves it."""
    tensors = {}
    for name, w in load_file(src / SINGLE_FILE).items():
        if FP8_WEIGHT.search(name) and ".kv_b_proj." not in name:
            if config.method == "int8":
                q, scale = quantize_int8(w)
                w = q.float() * scale[:, None]
            else:
                q, scale, minimum = quantize_int4(w, config.group_size)
                groups = q.view(w.shape[0], -1, config.group_size).float()
                w = (groups * scale[..., None] + minimum[..., None]).view(w.shape)
        tensors[name] = w
    return _write_plain(src, dst, tensors)


def _portable_kernels(monkeypatch) -> None:
    """Kernels whose arithmetic is exact fp32: the dequantizing ones (the int8 ones quantize activations, int4pack
    runs them in bf16)."""
    monkeypatch.setenv(NATIVE_ENV, "0")
    policy = KernelPolicy(cpu_features(), None, "test", 1)
    monkeypatch.setattr(loader, "default_policy", lambda: policy)
    monkeypatch.setattr(quant_linear, "int8_kernel", lambda *args: quant_linear.KernelChoice(Int8Linear.kernel, "test"))
    monkeypatch.setattr(quant_linear, "int4_kernel", lambda *args: quant_linear.KernelChoice(Int4Linear.kernel, "test"))


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_model_matches_transformers_on_the_quantized_weights(tmp_path, monkeypatch, method):
    config = QuantConfig(method, 32 if method == "int4" else None)
    src = make_checkpoint(tmp_path, "v3", **INT4_SHAPES)
    reference = _reference(_quantized_reference(src, tmp_path / "ref", config))
    _portable_kernels(monkeypatch)
    model = load_model(src, dtype=torch.float32, attn_config=ATTN, quantization=config)
    kinds = {type(m) for m in model.modules()}
    expected = {Int8Linear} if method == "int8" else {Int4Linear}
    assert expected <= kinds
    linears = [n for n, m in model.named_modules() if type(m) is Linear]
    assert sorted(linears) == ["lm_head"] + [f"model.layers.{i}.self_attn.attn.kv_b_proj" for i in range(2)]
    assert isinstance(model.model.layers[1].mlp.experts[7].down_proj, tuple(expected))
    for ours, theirs in zip(_logprobs(model), reference):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_model_with_this_cpus_kernels_stays_close(tmp_path, method):
    config = QuantConfig(method, 32 if method == "int4" else None)
    src = make_checkpoint(tmp_path, "v3", **INT4_SHAPES, hidden_size=64)  # latentserve's int4 kernel: 64 inputs
    reference = _reference(_quantized_reference(src, tmp_path / "ref", config))
    model = load_model(src, dtype=torch.float32, attn_config=ATTN, quantization=config)
    chosen = (quant_linear.int8_kernel(default_policy(), torch.device("cpu")) if method == "int8" else
              quant_linear.int4_kernel(default_policy(), torch.device("cpu"), 64, 64))
    assert type(model.model.layers[1].mlp.experts[0].gate_up_proj).kernel == chosen.kernel  # gate, up fused at load
    for ours, theirs in zip(_logprobs(model), reference):
        # Quantized activations or bf16 ones (int4pack on a bf16 CPU) on top of the same weights: close.
        # (Top-1 agreement is tested on real weights, test_accuracy.py: this random model's logits are near-flat.)
        error = (ours - theirs).abs()
        assert error.max() < 0.3 and error.mean() < 0.06  # a broken kernel: max > 2, mean > 0.1


def test_int4_group_that_does_not_divide_names_the_layer(tmp_path):
    src = make_checkpoint(tmp_path, "v3")  # intermediate_size 48
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj: int4 group size 32 does not divide "
                                         r"its 48 input columns"):
        load_model(src, quantization=QuantConfig("int4", 32))


def test_fp8_checkpoint_requantized_to_int8(tmp_path, monkeypatch):
    """int8 wins over the checkpoint's FP8: its weights are dequantized as published, then quantized."""
    src = make_checkpoint(tmp_path, "v3_nonorm")
    fp8 = _write_fp8(src, tmp_path / "fp8", (16, 16))
    plain = _write_plain(src, tmp_path / "plain", _dequantized_fp8(fp8, (16, 16)))
    reference = _reference(_quantized_reference(plain, tmp_path / "ref", QuantConfig("int8")))
    _portable_kernels(monkeypatch)
    model = load_model(fp8, dtype=torch.float32, attn_config=ATTN, quantization=QuantConfig("int8"))
    for ours, theirs in zip(_logprobs(model), reference):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


@pytest.mark.parametrize("native_bf16, dtype", [(True, torch.bfloat16), (False, torch.float32)])
def test_llm_auto_dtype_sets_weights_and_kv_cache(tmp_path, monkeypatch, native_bf16, dtype):
    from latentserve import LLM
    from latentserve.kernels.cpu import AUTO_DTYPE_ENV
    from latentserve.kernels.native import NATIVE_ENV

    monkeypatch.delenv(AUTO_DTYPE_ENV, raising=False)
    monkeypatch.delenv(NATIVE_ENV, raising=False)  # the CPU is simulated: no developer's build named
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512" if native_bf16 else "AVX2")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)  # ONEDNN_MAX_CPU_ISA aside
    src = make_checkpoint(tmp_path, "v3", dtype=torch.bfloat16)
    engine = LLM(model=str(src), num_kv_blocks=8, block_size=4, max_model_len=32).engine
    assert engine.model.lm_head.weight.dtype == dtype
    assert {cache.dtype for cache in engine.runner.kv_caches.values()} == {dtype}
    stored = load_file(src / SINGLE_FILE)["model.layers.0.self_attn.o_proj.weight"]
    assert torch.equal(engine.model.model.layers[0].self_attn.o_proj.weight, stored.to(dtype))


def test_llm_quantization_options(tmp_path):
    from latentserve import LLM, SamplingParams

    src = make_checkpoint(tmp_path, "v3_nonorm")
    llm = LLM(model=str(src), quantization="int8", num_kv_blocks=16, block_size=4, max_model_len=64)
    out = llm.generate([[5, 17, 33]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4
    assert not any(type(m) is Linear for m in llm.engine.model.model.layers[0].mlp.modules())
    with pytest.raises(ValueError, match="quantization='fp8' needs a DeepSeek FP8 checkpoint"):
        LLM(model=str(src), quantization="fp8")
    with pytest.raises(ValueError, match="quantization_group_size applies to int4 only"):
        LLM(model=str(src), quantization="int8", quantization_group_size=64)
