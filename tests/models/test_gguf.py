"""GGUF files in: config and tokenizer from the metadata, tensors under the Hugging Face names, quantized blocks
repacked into int4 where they map exactly. The files are written with gguf's GGUFWriter as llama.cpp's converter
writes deepseek2 (tests/models/gguf_checkpoint.py); gguf's own dequantization is the reference."""
from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import mmap
import re
from typing import Callable

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from latentserve import LLM, SamplingParams
from latentserve.engine.detokenizer import load_tokenizer
from latentserve.engine.llm import default_model_dir
from latentserve.kernels.policy import default_policy
from latentserve.layers.quant.config import QuantConfig
from latentserve.layers.quant.int4 import Int4Linear
from latentserve.layers.quant.int8 import Int8Linear, quantize_int8
from latentserve.layers.quant.linear import FILE_BLOCKS
from latentserve.layers.quant.prequantized import (Int4Weight, Int8Weight, Q2KWeight, Q3KWeight, Q4KWeight, Q5KWeight,
                                                   Q6KWeight, Q50Weight, Q51Weight, QuantizedWeight, concat)
from latentserve.layers.quant.q45 import NativeQ4KLinear, NativeQ5KLinear, NativeQ50Linear, NativeQ51Linear
from latentserve.layers.quant.q6k import NativeQ2KLinear, NativeQ3KLinear, NativeQ6KLinear
from latentserve.models import load_model
from latentserve.models.config import ModelConfig
from latentserve.models.formats import model_folder
from latentserve.models.formats import gguf as gguf_format
from latentserve.models.formats import gguf_weights
from latentserve.models.formats.gguf import read_tensors
from latentserve.models.moe_block import build_moe_block
from tests.checkpoints import make_checkpoint
from tests.models.gguf_checkpoint import k_quant_blocks, write_gguf
from tests.models.test_formats import ATTN, PROMPTS, _logprobs, _portable_kernels, _reference, _write_plain


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """The folders a GGUF's config and tokenizer go to, under the test's own directory."""
    monkeypatch.setattr(gguf_format, "cache_root", lambda: tmp_path / "gguf-cache")


# Not v2_group (YaRN mscale != mscale_all_dim: GGUF keeps one, llama.cpp runs them equal, as DeepSeek's configs
# have them) nor v3_nonorm (rope dims stored as halves: llama.cpp's deepseek2 rope takes them as DeepSeek stores
# them, in pairs).
@pytest.mark.parametrize("variant, kv_b", [("v3", "split"), ("v2_lite", "whole"), ("v3", "both")])
def test_f32_gguf_matches_its_safetensors(tmp_path, variant, kv_b):
    src = make_checkpoint(tmp_path, variant)
    path = tmp_path / "model.gguf"
    write_gguf(src, path, kv_b=kv_b)
    folder = model_folder(path)
    expected = ModelConfig.from_pretrained(src)
    config = ModelConfig.from_pretrained(folder)
    assert config == expected.__class__(**{**expected.__dict__, "num_nextn_predict_layers": 0})  # llama.cpp: no MTP
    model = load_model(path, dtype=torch.float32, attn_config=ATTN)
    plain = load_model(src, dtype=torch.float32, attn_config=ATTN)
    for name, tensor in plain.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    for ours, theirs in zip(_logprobs(model), _reference(src)):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


def test_llm_runs_a_gguf_file_as_its_safetensors(tmp_path):
    src = make_checkpoint(tmp_path, "v3")
    path = tmp_path / "model.gguf"
    write_gguf(src, path)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    kwargs = dict(num_kv_blocks=16, block_size=4, max_model_len=64, dtype="float32")
    ours = LLM(model=str(path), **kwargs).generate(PROMPTS, params)
    theirs = LLM(model=str(src), **kwargs).generate(PROMPTS, params)
    for a, b in zip(ours, theirs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys()
            for token in x:
                assert abs(x[token].logprob - y[token].logprob) < 1e-4


def test_split_gguf_loads_as_one(tmp_path):
    src = make_checkpoint(tmp_path, "v2_lite")
    write_gguf(src, tmp_path / "one.gguf")
    write_gguf(src, tmp_path / "split.gguf", split_max_tensors=20)
    parts = sorted(p.name for p in tmp_path.glob("split-*.gguf"))
    assert len(parts) > 1 and parts[0] == f"split-00001-of-{len(parts):05d}.gguf"
    one = load_model(tmp_path / "one.gguf", attn_config=ATTN).state_dict()
    split = load_model(tmp_path / parts[1], attn_config=ATTN).state_dict()  # any part names the whole
    assert one.keys() == split.keys() and all(torch.equal(one[n], split[n]) for n in one)
    (tmp_path / parts[-1]).unlink()
    with pytest.raises(FileNotFoundError, match=f"is part of a split GGUF of {len(parts)} files, but .* is missing"):
        load_model(tmp_path / parts[0])


def test_read_tensors_parses_each_file_once(tmp_path, monkeypatch):
    """Parsing a GGUF reads all its metadata (a real vocabulary's 100k strings: seconds), so each part once."""
    from gguf import GGUFReader

    src = make_checkpoint(tmp_path, "v2_lite")
    write_gguf(src, tmp_path / "one.gguf")
    write_gguf(src, tmp_path / "split.gguf", split_max_tensors=20)
    parts = sorted(p.name for p in tmp_path.glob("split-*.gguf"))
    expected = dict(read_tensors(model_folder(tmp_path / "one.gguf"), lambda name: True))
    folder = model_folder(tmp_path / parts[0])
    parsed = []

    def counting_reader(path):
        parsed.append(path.name)
        return GGUFReader(path)

    monkeypatch.setattr(gguf_format, "GGUFReader", counting_reader)
    read = dict(read_tensors(folder, lambda name: True))
    assert sorted(parsed) == parts
    assert read.keys() == expected.keys() and all(torch.equal(read[n], expected[n]) for n in read)


def _rss_anon_mib() -> float:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssAnon:")) / 1024


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "malloc_trim"), reason="glibc's malloc_trim")
def test_release_freed_heap_returns_what_numpy_temporaries_left():
    """Freed blocks of a few hundred KiB between blocks still in use (a load's temporaries between the weights it
    keeps) stay in glibc's heap, and the RSS, until trimmed."""
    np.ones(4_000_000)  # a 32 MB mapping, freed at once: glibc's mmap threshold rises past it, as in a load
    pairs = [(np.ones(100_000), np.ones(2000)) for _ in range(1000)]  # 800 KB temporaries, 800 MB, from the heap
    kept = [k for _, k in pairs]
    del pairs
    held = _rss_anon_mib()
    gguf_weights.release_freed_heap()
    assert held - _rss_anon_mib() > 500, (held, _rss_anon_mib())
    assert sum(k.sum() for k in kept) == 2000 * 1000


# Big enough for K-quants (256 values a row): every type on some weight.
SHAPES = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, q_lora_rank=256)
TYPES = [(r"attn_q_a\.", T.Q4_K), (r"attn_q_b\.", T.Q5_K), (r"attn_kv_a_mqa", T.Q3_K), (r"attn_output", T.Q4_0),
         (r"ffn_(gate|up)_exps", T.Q4_K), (r"ffn_down_exps", T.Q5_0), (r"ffn_(gate|up)_shexp", T.Q4_1),
         (r"ffn_down_shexp", T.Q5_1), (r"ffn_(gate|up)\.", T.Q2_K),
         (r"ffn_down\.", T.Q8_0), (r"^output\.", T.Q6_K), (r"token_embd", T.Q8_0), (r"attn_k_b", T.BF16),
         (r"attn_v_b", T.F16)]


def _kind(name: str, tensor) -> T:
    return next((kind for pattern, kind in TYPES if re.search(pattern, name)), T.F32)  # the router: F32


def _gguf_quantized(kind: T) -> Callable[[tuple[int, int], np.random.Generator], np.ndarray]:
    return lambda shape, gen: gguf.quants.quantize(gen.standard_normal(shape).astype(np.float32), kind)


# The types kept as their blocks: (GGUF type, random rows of it, the unpacking, q's bits, a row's width)
KEPT = {"Q6_K": (T.Q6_K, lambda shape, gen: k_quant_blocks(shape, T.Q6_K, gen), gguf_weights.q6k_weight, 6, 1024),
        "Q5_0": (T.Q5_0, _gguf_quantized(T.Q5_0), gguf_weights.q50_weight, 5, 1408),
        "Q5_1": (T.Q5_1, _gguf_quantized(T.Q5_1), gguf_weights.q51_weight, 5, 1408),
        "Q5_K": (T.Q5_K, lambda shape, gen: k_quant_blocks(shape, T.Q5_K, gen), gguf_weights.q5k_weight, 5, 1024),
        "Q4_K": (T.Q4_K, lambda shape, gen: k_quant_blocks(shape, T.Q4_K, gen), gguf_weights.q4k_weight, 4, 1024),
        "Q3_K": (T.Q3_K, lambda shape, gen: k_quant_blocks(shape, T.Q3_K, gen), gguf_weights.q3k_weight, 3, 1024),
        "Q2_K": (T.Q2_K, lambda shape, gen: k_quant_blocks(shape, T.Q2_K, gen), gguf_weights.q2k_weight, 2, 1024)}


@pytest.mark.parametrize("file_type", KEPT)
def test_kept_blocks_unpack_to_ggufs_dequantization(monkeypatch, file_type):
    """Q6_K's, Q5_0's, Q5_1's, Q5_K's, Q4_K's, Q3_K's and Q2_K's unpacked values give gguf's values to the bit,
    unpacked a few rows at a time or all at once; gate and up joined stay exact; without latentserve's kernel the
    weight is int8 per row, as gguf's values quantized (Q4_K: int4's groups of its values, exactly)."""
    kind, blocks, unpack, bits, width = KEPT[file_type]
    gen = np.random.default_rng(0)
    data = blocks((37, width), gen)
    whole = unpack(data)
    monkeypatch.setattr(gguf_weights, "_CHUNK_BYTES", 1000)
    weight = unpack(data)
    assert weight.shape == (37, width) and weight.q.dtype == torch.uint8 and int(weight.q.max()) < 1 << bits
    assert all(torch.equal(getattr(weight, f.name), getattr(whole, f.name)) for f in dataclasses.fields(weight))
    expected = torch.from_numpy(gguf.quants.dequantize(data, kind))
    assert torch.equal(weight.dequantize(), expected)
    up = blocks((5, width), gen)
    joined = concat([weight, unpack(up)])
    assert type(joined) is type(weight)
    assert torch.equal(joined.dequantize(), torch.cat([expected, torch.from_numpy(gguf.quants.dequantize(up, kind))]))
    q, scale = quantize_int8(expected)
    assert torch.equal(weight.int8().q, q) and torch.equal(weight.int8().scale, scale)
    unkept = weight.unkept_weight()
    if file_type == "Q4_K":
        assert isinstance(unkept, Int4Weight) and unkept.group_size == 32
        assert torch.equal(unkept.dequantize(), expected)
    else:
        assert isinstance(unkept, Int8Weight) and torch.equal(unkept.q, q)


def _held(weight: QuantizedWeight, native: bool) -> torch.Tensor:
    """A loaded weight's values as its layer runs them: the kept blocks' own through latentserve's kernels for them,
    else (without latentserve's kernels) their unkept layout's (int8 per row; Q4_K: its own values as int4)."""
    kept = type(weight) in FILE_BLOCKS
    return (weight.unkept_weight() if kept and not native else weight).dequantize()


def test_quantized_gguf_loads_gguf_dequantization(tmp_path, monkeypatch, caplog):
    """Q4_0 / Q4_1 weights become int4, Q4_K, Q6_K, Q5_0, Q5_1, Q5_K, Q3_K and Q2_K ones their blocks, exactly gguf's
    dequantized values; Q8_0 ones are dequantized by gguf and quantized to int8 per row; the model runs those
    weights as transformers does (the kept blocks as int8 per row, without latentserve's kernels)."""
    monkeypatch.setattr(gguf_weights, "_CHUNK_BYTES", 1000)  # big tensors are dequantized a few rows at a time
    src = make_checkpoint(tmp_path, "v3", **SHAPES)
    path = tmp_path / "model.gguf"
    values = write_gguf(src, path, _kind)
    folder = model_folder(path)
    assert ModelConfig.from_pretrained(folder).quantization.method == "int4"
    with caplog.at_level(logging.INFO):
        read = dict(read_tensors(folder, lambda name: True))
    assert re.search(r"repacked into int4 groups of 32 without requantizing: 2 Q4_0, 2 Q4_1; kept as their blocks: "
                     r"2 Q2_K, 2 Q3_K, 18 Q4_K, 8 Q5_0, 1 Q5_1, 2 Q5_K, 1 Q6_K; dequantized and quantized to int8 per "
                     r"output channel: 1 Q8_0; dequantized to the compute dtype: 1 Q8_0", caplog.text)
    experts = values["blk.1.ffn_gate_exps.weight"]
    for name, expected in [
        ("model.layers.1.self_attn.o_proj.weight", values["blk.1.attn_output.weight"]),
        ("model.layers.1.mlp.shared_experts.gate_proj.weight", values["blk.1.ffn_gate_shexp.weight"]),
    ]:
        weight = read[name]
        assert isinstance(weight, Int4Weight) and weight.group_size == 32, name
        assert torch.equal(weight.dequantize(), torch.from_numpy(expected)), name
    shared_down = values["blk.1.ffn_down_shexp.weight"]
    for name, expected in [("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", values["blk.0.attn_kv_a_mqa.weight"]),
                           ("model.layers.1.mlp.shared_experts.down_proj.weight", shared_down),
                           ("lm_head.weight", values["output.weight"]),
                           ("model.layers.1.mlp.experts.5.down_proj.weight", values["blk.1.ffn_down_exps.weight"][5]),
                           ("model.layers.0.self_attn.q_b_proj.weight", values["blk.0.attn_q_b.weight"]),
                           ("model.layers.0.self_attn.q_a_proj.weight", values["blk.0.attn_q_a.weight"]),
                           ("model.layers.1.mlp.experts.3.gate_proj.weight", experts[3]),
                           ("model.layers.0.mlp.up_proj.weight", values["blk.0.ffn_up.weight"])]:
        kind = (Q2KWeight if "layers.0.mlp" in name else Q4KWeight if "q_a_proj" in name or "gate_proj" in name
                else Q50Weight if ".experts." in name else Q3KWeight if "kv_a_proj" in name
                else Q5KWeight if "q_b_proj" in name else Q51Weight if "shared_experts" in name else Q6KWeight)
        assert type(read[name]) is kind, name
        assert torch.equal(read[name].dequantize(), torch.from_numpy(expected)), name
    q, scale = quantize_int8(torch.from_numpy(values["blk.0.ffn_down.weight"]))
    weight = read["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(weight, Int8Weight) and torch.equal(weight.q, q) and torch.equal(weight.scale, scale)
    assert torch.equal(read["model.embed_tokens.weight"], torch.from_numpy(values["token_embd.weight"]))

    # The model: each weight as its layer holds it, run by transformers against ours (exact fp32 kernels).
    plain = {name: _held(w, False) if isinstance(w, QuantizedWeight) else w for name, w in read.items()}
    reference = _reference(_write_plain(src, tmp_path / "plain", plain))
    _portable_kernels(monkeypatch)
    model = load_model(path, dtype=torch.float32, attn_config=ATTN, quantization=QuantConfig("int4", lm_head=True))
    assert isinstance(model.model.layers[1].mlp.experts[3].gate_up_proj, Int4Linear)
    assert isinstance(model.model.layers[1].mlp.experts[3].down_proj, Int8Linear)
    for kept in (model.lm_head, model.model.layers[1].mlp.shared_experts.down_proj,
                 model.model.layers[1].self_attn.kv_a_proj_with_mqa, model.model.layers[1].mlp.experts[3].down_proj,
                 model.model.layers[1].self_attn.q_b_proj):
        assert isinstance(kept, Int8Linear)
    gate_up = model.model.layers[1].mlp.experts[3].gate_up_proj.dequantized()
    assert torch.equal(gate_up, torch.cat([torch.from_numpy(experts[3]),
                                           torch.from_numpy(values["blk.1.ffn_up_exps.weight"][3])]))
    for ours, theirs in zip(_logprobs(model), reference):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


def test_tokenizer_from_metadata_matches_the_hf_tokenizer(tmp_path):
    src = make_checkpoint(tmp_path, "v3_nonorm")
    path = tmp_path / "model.gguf"
    write_gguf(src, path, tokenizer_dir=default_model_dir())
    ours, theirs = load_tokenizer(model_folder(path)), load_tokenizer(default_model_dir())
    texts = ["And God said, Let there be light: and there was light.", "  leading spaces\tand\ttabs\n\nnew lines",
             "numbers 1234567 and 3.14159, émigré naïveté, 日本語のテキスト, emoji 🙂!",
             "<|User|>hello<|Assistant|>hi there<|end_of_text|>"]
    for text in texts:
        assert ours.encode(text) == theirs.encode(text), text
        ids = theirs.encode(text)
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
    # (BOS comes from add_bos_token here, from tokenizer.json's post-processor there: encode checked both.)
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
    assert ours.chat_template == theirs.chat_template


def test_deepseek_v3_pre_tokenizer_splits_as_llama_cpp_documents(tmp_path):
    from latentserve.models.formats.gguf_tokenizer import _pre_tokenizer

    pieces = [p for p, _ in _pre_tokenizer("deepseek-v3").pre_tokenize_str("abc 12345 日本語 x!?y")]
    # Numbers in runs of at most 3, CJK runs apart, punctuation + letters as one, bytes mapped (Ġ is a space).
    assert pieces == ["abc", "Ġ", "123", "45", "Ġ", "æĹ¥æľ¬èªŀ", "Ġx", "!?", "y"]


def test_gguf_errors_name_what_is_wrong(tmp_path):
    src = make_checkpoint(tmp_path, "v3_nonorm")
    w = gguf.GGUFWriter(tmp_path / "llama.gguf", "llama")
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match="general.architecture is 'llama'; latentserve reads 'deepseek2'"):
        load_model(tmp_path / "llama.gguf")
    write_gguf(src, tmp_path / "model.gguf", skip={"blk.1.attn_v_b.weight"})
    assert not (model_folder(tmp_path / "model.gguf") / "tokenizer.json").exists()  # none in it: ids only
    with pytest.raises(ValueError, match=r"not both attn_k_b and attn_v_b for model.layers.1.self_attn.kv_b_proj"):
        load_model(tmp_path / "model.gguf", attn_config=ATTN)


def test_quantized_gguf_with_this_cpus_kernels_stays_close(tmp_path):
    """The kept blocks (Q4_K, Q6_K, Q5_0, Q5_1, Q5_K, Q3_K, Q2_K) through latentserve's kernels for them where they
    build (int8 activations), int4pack_mm and int8 per row elsewhere: close to the exact weights."""
    src = make_checkpoint(tmp_path, "v3", **SHAPES)
    path = tmp_path / "model.gguf"
    write_gguf(src, path, _kind)
    read = dict(read_tensors(model_folder(path), lambda name: True))
    native = default_policy().kernels is not None
    plain = {name: _held(w, native) if isinstance(w, QuantizedWeight) else w for name, w in read.items()}
    reference = _reference(_write_plain(src, tmp_path / "plain", plain))
    model = load_model(path, dtype=torch.float32, attn_config=ATTN, quantization=QuantConfig("int4", lm_head=True))
    # The bounds are this draw's: from one draw of the K-quant blocks to another, the activations' int8 rounding
    # alone moved this random model's log-probs by 0.2 to 1.5 at most (mean 0.03 to 0.12), with Q6_K's blocks or int8
    # per row alike. This draw: 0.43 (mean 0.047) with latentserve's kernels, 0.25 (0.035) with PyTorch's.
    for ours, theirs in zip(_logprobs(model), reference):
        error = (ours - theirs).abs()
        assert error.max() < 0.5 and error.mean() < 0.06
    if native:
        moe = model.model.layers[1].mlp
        assert isinstance(model.lm_head, NativeQ6KLinear)
        assert isinstance(moe.shared_experts.down_proj, NativeQ51Linear)
        assert all(isinstance(expert.down_proj, NativeQ50Linear) for expert in moe.experts)
        assert isinstance(model.model.layers[1].self_attn.q_b_proj, NativeQ5KLinear)
        assert isinstance(model.model.layers[1].self_attn.q_a_proj, NativeQ4KLinear)
        assert isinstance(model.model.layers[0].mlp.gate_up_proj, NativeQ2KLinear)
        assert all(isinstance(layer.self_attn.kv_a_proj_with_mqa, NativeQ3KLinear) for layer in model.model.layers)
        assert model.lm_head.out_dtype == torch.float32  # the logits stay fp32
        # Q4_K gate and up beside Q5_0 down, the shared Q4_1 (int4) beside Q5_1: still the one-call block
        built, _ = build_moe_block(moe, torch.float32)
        assert built is not None
        assert list(built[0].routed.bits) == [4, 5] and list(built[0].routed.group) == [256, 32]
        assert list(built[0].routed.mins) == [0, 0]
        assert (list(built[0].shared.bits), list(built[0].shared.group), list(built[0].shared.mins)) == (
            [4, 5], [32, 32], [0, 1])


def test_expert_shard_converts_only_its_experts(tmp_path, monkeypatch):
    """Expert parallelism: a rank takes its routed experts' rows of the stacked GGUF tensors, and no others."""
    from latentserve.distributed.expert_parallel import RemoteExpert
    from tests.models.test_loader import _shard

    src = make_checkpoint(tmp_path, "v3")
    path = tmp_path / "model.gguf"
    write_gguf(src, path)
    converted = []
    convert = gguf_format._convert
    monkeypatch.setattr(gguf_format, "_convert", lambda t, name, *a: converted.append(name) or convert(t, name, *a))
    model = load_model(path, attn_config=ATTN, prepare=_shard(1, 2))
    experts = model.model.layers[1].mlp.experts
    assert [isinstance(e, RemoteExpert) for e in experts] == [True] * 4 + [False] * 4
    assert not [n for n in converted if re.search(r"\.experts\.[0-3]\.", n)]
    plain = load_model(src, attn_config=ATTN, prepare=_shard(1, 2)).state_dict()
    assert all(torch.equal(t, plain[n]) for n, t in model.state_dict().items())


def _rss_file_mib() -> float:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssFile:")) / 1024


@pytest.mark.skipif(not hasattr(mmap, "MADV_DONTNEED"), reason="madvise")
def test_read_tensors_gives_back_each_tensors_mapped_pages(tmp_path):
    """The file is mapped and every page a conversion reads counts as the process's memory: each tensor's pages
    are given back once it is converted, so at most about one tensor's are held, not the whole file's."""
    path = tmp_path / "big.gguf"
    w = gguf.GGUFWriter(path, "deepseek2")
    names = ["blk.0.ffn_gate.weight", "blk.0.ffn_up.weight", "blk.0.ffn_down.weight", "output.weight"]
    for i, name in enumerate(names):  # 16 MiB each, F32: the conversion copies it
        w.add_tensor(name, np.full((1024, 4096), i, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / gguf_format.GGUF_INDEX).write_text(json.dumps({"files": [str(path)]}))
    hf_names = ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
                "model.layers.0.mlp.down_proj.weight", "lm_head.weight"]
    before, held = _rss_file_mib(), []
    for name, tensor in read_tensors(folder, lambda name: True):
        held.append(_rss_file_mib() - before)
        assert torch.equal(tensor, torch.full((1024, 4096), float(hf_names.index(name))))
    assert len(held) == 4 and max(held) < 24, held  # without giving pages back: 16, 32, 48, 64 MiB


def test_embedding_and_lm_head_first_then_each_experts_gate_and_up_together(tmp_path):
    """The largest tensors come first, while little is loaded beside their conversion's temporaries. The loader
    fuses an expert's gate and up and holds the first until the second comes: read from the stacked tensors as
    stored (all gates, then all ups), a whole layer's gates would wait, unpacked."""
    src = make_checkpoint(tmp_path, "v3")
    write_gguf(src, tmp_path / "model.gguf")
    names = [name for name, _ in read_tensors(model_folder(tmp_path / "model.gguf"), lambda name: True)]
    assert sorted(names[:3]) == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]
    gates = [i for i, name in enumerate(names) if re.search(r"\.experts\.\d+\.gate_proj", name)]
    assert len(gates) == 8
    assert all(names[i + 1] == names[i].replace("gate_proj", "up_proj") for i in gates)
