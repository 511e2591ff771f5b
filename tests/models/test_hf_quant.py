"""GPTQ, AWQ and compressed-tensors checkpoints load into latentserve's int4 / int8 layers without a second
quantization. compressed-tensors' own compressors write and decompress its tensors; GPTQ and AWQ (whose libraries
need CUDA) are packed here from their documented layouts, and dequantized by a reference written from the same
spec: w = (q - zero) * scale per group (GPTQ's group of column i is g_idx[i]; its v1 checkpoints store zero - 1)."""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from latentserve.kernels.policy import default_policy
from latentserve.layers.quant import linear as quant_linear
from latentserve.layers.quant.config import QuantConfig
from latentserve.layers.quant.int4 import Int4Linear, quantize_int4
from latentserve.layers.quant.int8 import Int8Linear
from latentserve.layers.quant.prequantized import Int4Weight, Int8Weight
from latentserve.models import load_model
from latentserve.models.config import ModelConfig
from latentserve.models.loader import SINGLE_FILE, open_checkpoint
from tests.checkpoints import make_checkpoint
from tests.models.test_formats import ATTN, _logprobs, _portable_kernels, _reference, _write_plain

# Every input a multiple of 128 (GPTQ/AWQ's usual group), outputs of 8s (their zeros pack 8 outputs an int32).
SHAPES = dict(hidden_size=128, intermediate_size=128, moe_intermediate_size=128, q_lora_rank=128, kv_lora_rank=128,
              num_attention_heads=8, num_key_value_heads=8, v_head_dim=16)
QUANTIZED = re.compile(r"\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|gate_proj|up_proj|down_proj)"
                       r"\.weight$")
SHIFTS = np.arange(0, 32, 4, dtype=np.uint32)


def _pack8(values: torch.Tensor, axis: int) -> torch.Tensor:
    """int32 holding 8 4-bit values each, consecutive along `axis`, value k at bits 4k."""
    v = values.numpy().astype(np.uint32)
    v = np.moveaxis(v, axis, -1)
    v = v.reshape(*v.shape[:-1], -1, 8)
    packed = np.bitwise_or.reduce(v << SHIFTS, axis=-1)
    return torch.from_numpy(np.ascontiguousarray(np.moveaxis(packed, -1, axis)).view(np.int32))


def _rtn(w: torch.Tensor, g_idx: torch.Tensor, groups: int, gen: torch.Generator, lowest_zero: int = 0):
    """q `[in, out]` in [0, 15], scale fp16 `[groups, out]`, zero `[groups, out]` in [lowest_zero, 15] of `w`
    `[out, in]`."""
    scale = (w.abs().amax() / 8 * (0.5 + torch.rand(groups, w.shape[0], generator=gen))).half()
    zero = torch.randint(lowest_zero, 16, (groups, w.shape[0]), generator=gen)
    s, z = scale.float()[g_idx], zero[g_idx]  # [in, out]
    q = (w.t() / s + z).round().clamp(0, 15).to(torch.uint8)
    return q, scale, zero


def _gptq(w, group, gen, g_idx=None, v1=True):
    g_idx = torch.arange(w.shape[1]) // group if g_idx is None else g_idx
    # v1 stores zero - 1 in 4 bits, so its zeros are 1..16: GPTQ's quantizer never makes a 0 there.
    q, scale, zero = _rtn(w, g_idx, w.shape[1] // group, gen, lowest_zero=int(v1))
    tensors = {"qweight": _pack8(q, 0), "qzeros": _pack8(zero - int(v1), 1), "scales": scale,
               "g_idx": g_idx.int()}
    return tensors, ((q.float() - zero[g_idx]) * scale.float()[g_idx]).t()


def _awq(w, group, gen):
    g_idx = torch.arange(w.shape[1]) // group
    q, scale, zero = _rtn(w, g_idx, w.shape[1] // group, gen)
    order = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble k of an int32 holds output 8j + order[k] (AutoAWQ's GEMM pack)
    interleave = lambda t: t.view(t.shape[0], -1, 8)[..., order].reshape(t.shape)  # noqa: E731
    tensors = {"qweight": _pack8(interleave(q), 1), "qzeros": _pack8(interleave(zero), 1), "scales": scale}
    return tensors, ((q.float() - zero[g_idx]) * scale.float()[g_idx]).t()


def _write(src: Path, dst: Path, quantize, config: dict) -> tuple[Path, dict[str, torch.Tensor]]:
    """`src` with every attention / MLP weight replaced by `quantize(name, w)`'s tensors; the reference weights."""
    tensors, reference = {}, {}
    for name, w in load_file(src / SINGLE_FILE).items():
        if not QUANTIZED.search(name):
            tensors[name] = w
            continue
        prefix = name.removesuffix(".weight")
        parts, reference[name] = quantize(name, w)
        tensors.update({f"{prefix}.{part}": t.contiguous() for part, t in parts.items()})
    dst.mkdir()
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = config
    (dst / "config.json").write_text(json.dumps(raw))
    save_file(tensors, dst / SINGLE_FILE, metadata={"format": "pt"})
    return dst, reference


def _unpacked(path: Path) -> dict[str, object]:
    config = ModelConfig.from_pretrained(path)
    return {name: t for name, t in open_checkpoint(path, config, lambda name: True) if QUANTIZED.search(name)}


def _check_loads_exactly(tmp_path, monkeypatch, src, path, reference, method="int4"):
    """The unpacked weights are the format's own dequantization, bit for bit; the model runs them as transformers
    runs that dequantization."""
    unpacked = _unpacked(path)
    assert unpacked.keys() == reference.keys()
    for name, weight in unpacked.items():
        assert isinstance(weight, Int4Weight if method == "int4" else Int8Weight), name  # no second quantization
        assert torch.equal(weight.dequantize(), reference[name].float()), name
    plain = _write_plain(src, tmp_path / "plain", {**load_file(src / SINGLE_FILE), **reference})
    _portable_kernels(monkeypatch)
    model = load_model(path, dtype=torch.float32, attn_config=ATTN, quantization=QuantConfig(method))
    down = model.model.layers[1].mlp.experts[5].down_proj
    assert isinstance(down, Int4Linear if method == "int4" else Int8Linear)
    expected = reference["model.layers.1.mlp.experts.5.down_proj.weight"].float()
    assert torch.equal(down.dequantized() if method == "int4" else down.qweight.float() * down.scale[:, None],
                       expected)
    for ours, theirs in zip(_logprobs(model), _reference(plain)):
        assert theirs.std(-1).min() > 0.3
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


@pytest.mark.parametrize("v1", [True, False])
def test_gptq_group_128(tmp_path, monkeypatch, v1):
    src = make_checkpoint(tmp_path, "v3", **SHAPES)
    gen = torch.Generator().manual_seed(0)
    config = dict(quant_method="gptq", bits=4, group_size=128, desc_act=False, sym=False,
                  checkpoint_format="gptq" if v1 else "gptq_v2")
    path, reference = _write(src, tmp_path / "gptq", lambda name, w: _gptq(w, 128, gen, v1=v1), config)
    _check_loads_exactly(tmp_path, monkeypatch, src, path, reference)


def test_gptq_act_order_permuting_groups_maps_exactly(tmp_path, monkeypatch):
    """act-order whose g_idx gives each run of 32 columns one group, in permuted order: scales and zeros follow."""
    src = make_checkpoint(tmp_path, "v3", **SHAPES)
    gen = torch.Generator().manual_seed(1)

    def quantize(name, w):
        g_idx = torch.randperm(w.shape[1] // 32, generator=gen).repeat_interleave(32)
        return _gptq(w, 32, gen, g_idx)

    config = dict(quant_method="gptq", bits=4, group_size=32, desc_act=True, sym=False)
    path, reference = _write(src, tmp_path / "gptq", quantize, config)
    _check_loads_exactly(tmp_path, monkeypatch, src, path, reference)


def test_gptq_act_order_scattering_groups_is_quantized_again(tmp_path, monkeypatch, caplog):
    """A g_idx that spreads a group over the columns cannot be contiguous groups: the exact dequantization is
    quantized to int4 at load, and the log says so."""
    src = make_checkpoint(tmp_path, "v3", **SHAPES)
    gen = torch.Generator().manual_seed(2)

    def quantize(name, w):
        g_idx = (torch.arange(w.shape[1]) // 32)[torch.randperm(w.shape[1], generator=gen)]
        return _gptq(w, 32, gen, g_idx)

    config = dict(quant_method="gptq", bits=4, group_size=32, desc_act=True, sym=False)
    path, reference = _write(src, tmp_path / "gptq", quantize, config)
    with caplog.at_level(logging.WARNING):
        unpacked = _unpacked(path)
    assert "dequantized and quantized again at load" in caplog.text
    for name, weight in unpacked.items():
        assert torch.equal(weight, reference[name]), name
    _portable_kernels(monkeypatch)
    model = load_model(path, dtype=torch.float32, attn_config=ATTN, quantization=QuantConfig("int4"))
    q, scale, minimum = quantize_int4(reference["model.layers.0.self_attn.o_proj.weight"], 128)
    o_proj = model.model.layers[0].self_attn.o_proj
    assert torch.equal(o_proj.scale, scale) and torch.equal(o_proj.minimum, minimum)


def test_awq_group_128(tmp_path, monkeypatch):
    src = make_checkpoint(tmp_path, "v3", **SHAPES)
    gen = torch.Generator().manual_seed(3)
    config = dict(quant_method="awq", bits=4, group_size=128, zero_point=True, version="gemm")
    path, reference = _write(src, tmp_path / "awq", lambda name, w: _awq(w, 128, gen), config)
    _check_loads_exactly(tmp_path, monkeypatch, src, path, reference)


def _compressed_tensors(w4a16: bool, symmetric: bool):
    """(quantize(name, w) through compressed-tensors' own compressor, its decompression as the reference; the
    quantization_config its QuantizationConfig writes)."""
    from compressed_tensors.compressors import IntQuantizationCompressor, PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    if w4a16:
        weights = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=128)
        scheme, compressor = QuantizationScheme(targets=["Linear"], weights=weights), PackedQuantizationCompressor
    else:
        scheme = QuantizationScheme(
            targets=["Linear"], weights=QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel"),
            input_activations=QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token",
                                               dynamic=True))
        compressor = IntQuantizationCompressor
    gen = torch.Generator().manual_seed(4)

    def quantize(name, w):
        shape = (w.shape[0], w.shape[1] // 128) if w4a16 else (w.shape[0], 1)
        levels = (7 if symmetric else 15) if w4a16 else 127
        # Scales in the checkpoint's dtype, as llm-compressor saves them; decompressed in fp32 for the reference.
        scale = (w.abs().amax() / levels * (0.5 + torch.rand(shape, generator=gen))).bfloat16()
        state = {"weight": w, "weight_scale": scale.float()}
        if not symmetric:
            state["weight_zero_point"] = torch.randint(-8, 8, shape, generator=gen).to(torch.int8)
        packed = compressor.compress(state, scheme)
        reference = compressor.decompress(packed, scheme)["weight"]
        return {**packed, "weight_scale": scale}, reference

    layout = "pack-quantized" if w4a16 else "int-quantized"
    config = QuantizationConfig(config_groups={"group_0": scheme}, format=layout, ignore=["lm_head"])
    return quantize, json.loads(json.dumps(config.model_dump(), default=str))


@pytest.mark.parametrize("symmetric", [True, False])
def test_compressed_tensors_w4a16(tmp_path, monkeypatch, symmetric):
    pytest.importorskip("compressed_tensors")
    src = make_checkpoint(tmp_path, "v3", **SHAPES)
    quantize, config = _compressed_tensors(True, symmetric)
    path, reference = _write(src, tmp_path / "ct", quantize, config)
    _check_loads_exactly(tmp_path, monkeypatch, src, path, reference)


def test_compressed_tensors_w8a8_channel(tmp_path, monkeypatch):
    pytest.importorskip("compressed_tensors")
    src = make_checkpoint(tmp_path, "v3", **SHAPES)
    quantize, config = _compressed_tensors(False, True)
    path, reference = _write(src, tmp_path / "ct", quantize, config)
    _check_loads_exactly(tmp_path, monkeypatch, src, path, reference, method="int8")


def test_gptq_loaded_as_int8_is_dequantized_first(tmp_path, monkeypatch):
    src = make_checkpoint(tmp_path, "v3", **SHAPES)
    gen = torch.Generator().manual_seed(5)
    config = dict(quant_method="gptq", bits=4, group_size=128, desc_act=False, sym=True)
    path, reference = _write(src, tmp_path / "gptq", lambda name, w: _gptq(w, 128, gen), config)
    _portable_kernels(monkeypatch)
    model = load_model(path, dtype=torch.float32, attn_config=ATTN, quantization=QuantConfig("int8"))
    o_proj = model.model.layers[0].self_attn.o_proj
    assert isinstance(o_proj, Int8Linear)
    from latentserve.layers.quant.int8 import quantize_int8

    q, scale = quantize_int8(reference["model.layers.0.self_attn.o_proj.weight"])
    assert torch.equal(o_proj.qweight, q) and torch.equal(o_proj.scale, scale)


@pytest.mark.parametrize("config, error", [
    (dict(quant_method="gptq", bits=8, group_size=128), "field 'bits' is 8; supported: \\[4\\]"),
    (dict(quant_method="gptq", bits=4, group_size=-1), "per-channel -1 is not supported"),
    (dict(quant_method="awq", bits=4, group_size=128, version="gemv"), "field 'version' is 'gemv'"),
    (dict(quant_method="compressed-tensors", format="float-quantized", config_groups={"g": {"weights": {}}}),
     "compressed-tensors format 'float-quantized'"),
])
def test_unsupported_quantization_configs_name_the_field(tmp_path, config, error):
    src = make_checkpoint(tmp_path, "v3_nonorm")
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = config
    (src / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=error):
        load_model(src)


def test_missing_part_names_the_layer(tmp_path):
    src = make_checkpoint(tmp_path, "v3", **SHAPES)
    gen = torch.Generator().manual_seed(6)
    config = dict(quant_method="awq", bits=4, group_size=128, zero_point=True, version="gemm")
    path, _ = _write(src, tmp_path / "awq", lambda name, w: _awq(w, 128, gen), config)
    tensors = load_file(path / SINGLE_FILE)
    del tensors["model.layers.0.self_attn.o_proj.qzeros"]
    save_file(tensors, path / SINGLE_FILE)
    with pytest.raises(ValueError, match="awq layer 'model.layers.0.self_attn.o_proj' is missing \\['qzeros'\\]"):
        load_model(path, quantization=QuantConfig("int4"))


def test_llm_loads_a_gptq_checkpoint_in_int4(tmp_path):
    from latentserve import LLM, SamplingParams

    src = make_checkpoint(tmp_path, "v3", **SHAPES)
    gen = torch.Generator().manual_seed(7)
    config = dict(quant_method="gptq", bits=4, group_size=128, desc_act=False, sym=True)
    path, _ = _write(src, tmp_path / "gptq", lambda name, w: _gptq(w, 128, gen), config)
    kwargs = dict(num_kv_blocks=16, block_size=4, max_model_len=64)
    llm = LLM(model=str(path), **kwargs)
    down = llm.engine.model.model.layers[1].mlp.experts[0].down_proj
    assert down.kernel == quant_linear.int4_kernel(default_policy(), torch.device("cpu"), 128, 128).kernel
    out = llm.generate([[5, 17, 33]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="quantization='fp8' needs a DeepSeek FP8 checkpoint .* stored as gptq"):
        LLM(model=str(path), quantization="fp8", **kwargs)


def test_expert_shard_reads_only_its_experts_parts(tmp_path, monkeypatch):
    from latentserve.distributed.expert_parallel import RemoteExpert
    from latentserve.models import safetensors_reader
    from tests.models.test_loader import _shard

    src = make_checkpoint(tmp_path, "v3", **SHAPES)
    gen = torch.Generator().manual_seed(8)
    config = dict(quant_method="awq", bits=4, group_size=128, zero_point=True, version="gemm")
    path, _ = _write(src, tmp_path / "awq", lambda name, w: _awq(w, 128, gen), config)
    reads = []
    read = safetensors_reader._read
    monkeypatch.setattr(safetensors_reader, "_read",
                        lambda f, entry, file: reads.append(entry.name) or read(f, entry, file))
    model = load_model(path, attn_config=ATTN, quantization=QuantConfig("int4"), prepare=_shard(1, 2))
    assert [isinstance(e, RemoteExpert) for e in model.model.layers[1].mlp.experts] == [True] * 4 + [False] * 4
    assert not [n for n in reads if re.search(r"\.experts\.[0-3]\.", n)]
    assert "model.layers.1.mlp.experts.4.down_proj.qzeros" in reads
