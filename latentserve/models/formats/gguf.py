"""DeepSeek-2 architecture GGUF files (llama.cpp's; one file or a split `-00001-of-0000N.gguf`), read with the `gguf`
package: `open_gguf` writes the config.json, tokenizer.json and tokenizer_config.json its metadata describes into a
small folder of latentserve's cache, and `read_tensors` streams its tensors under the Hugging Face names, in the
layout transformers' DeepSeek models keep them.

llama.cpp's converter stacks each layer's routed experts into one tensor (`ffn_*_exps`), and its current version
splits `kv_b_proj` into `attn_k_b` (per head, transposed: `[heads, kv_lora_rank, qk_nope]`) and `attn_v_b`; older
files keep `attn_kv_b`. Both come back as `kv_b_proj`.

Weights: Q4_0 and Q4_1 map onto latentserve's int4 layout exactly (groups of 32 columns, w = q * scale + minimum: Q4_0's
scale d and minimum -8d, Q4_1's d and m) and are repacked, not requantized. The loaded weights hold the file's values
exactly; latentserve's int4 kernel then keeps each group's scale and minimum in bf16 (as int4pack_mm does), so it runs
them to bf16's precision. Q4_K (most of a Q4_K_M file), Q6_K (its output matrix, some of its down projections), Q5_0
(its down projections whose rows are not a multiple of 256), Q5_K (Q5_K_M's) and Q5_1 (Q5_K_M's where Q4_K_M has Q5_0)
are kept as their blocks' values, exactly, which latentserve's kernels for them run as they are (4.75, 6.625, 5.5, 5.75
and 6 bits a weight read), as are Q3_K (most of a Q3_K_M file: 3.625 bits read) and Q2_K (a Q2_K file's: 2.75). Without
those kernels a Q4_K layer runs as int4's groups of its values, the others are quantized to int8 per output channel
(layers/quant/linear.py). Other quantized types of an attention or MLP weight (Q8_0 has one scale per 32 values, not
per row) are dequantized with gguf's own code and quantized to int8 per output channel; embeddings, norms, the router
and kv_b_proj (which decode absorbs) are dequantized to the compute dtype. The load log counts each; the conversions
themselves are gguf_weights.py's."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from latentserve.kernels.native import CACHE_ENV
from latentserve.models.formats.gguf_weights import (FLOAT_TYPES, INT4_TYPES, ConversionStats, dequantized,
                                                     int4_weight, int8_weight, q2k_weight, q3k_weight, q4k_weight,
                                                     q5k_weight, q6k_weight, q50_weight, q51_weight,
                                                     release_freed_heap, release_mapped_pages)
from latentserve.models.formats.gguf_tokenizer import build_tokenizer, unsupported_reason

logger = logging.getLogger(__name__)

ARCHITECTURE = "deepseek2"
GGUF_INDEX = "gguf.json"  # in the folder open_gguf writes: the GGUF files it stands for
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
# GGUF tensor (per layer) -> Hugging Face name under model.layers.{i}.
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}
_EXPERTS = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj", "ffn_down_exps.weight": "down_proj"}
_GATE_EXPS, _UP_EXPS = "ffn_gate_exps.weight", "ffn_up_exps.weight"
_K_B, _V_B = "attn_k_b.weight", "attn_v_b.weight"
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
# The weights latentserve runs as int8/int4 layers (kv_b_proj stays in the compute dtype: decode absorbs it).
_QUANTIZED_LAYER = re.compile(r"(\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|o_proj|gate_proj|up_proj|down_proj)"
                              r"\.weight|^lm_head\.weight)$")
# Types whose blocks latentserve's kernels read as the file holds them (layers/quant/linear.py FILE_BLOCKS).
_KEPT = {GGMLQuantizationType.Q6_K: q6k_weight, GGMLQuantizationType.Q3_K: q3k_weight,
         GGMLQuantizationType.Q2_K: q2k_weight, GGMLQuantizationType.Q5_0: q50_weight,
         GGMLQuantizationType.Q5_1: q51_weight, GGMLQuantizationType.Q5_K: q5k_weight,
         GGMLQuantizationType.Q4_K: q4k_weight}


def is_gguf(path: Path) -> bool:
    return path.suffix == ".gguf" and path.is_file()


def gguf_files(path: Path) -> list[Path]:
    """The file, or every part of the split it is one of (`name-00001-of-00003.gguf`), in order."""
    match = _SPLIT.match(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    files = [path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"{path.name} is part of a split GGUF of {count} files, but {file} is missing")
    return files


def _metadata(reader: GGUFReader) -> dict[str, Any]:
    """The file's key-value metadata; a float32 as the shortest decimal that is that float32 (the converter wrote
    config.json's 1e-06 as float32: this gives back 1e-06, not 9.999999974752427e-07)."""

    def value(field) -> Any:
        if field.types == [GGUFValueType.FLOAT32]:
            return float(str(np.float32(field.contents())))
        return field.contents()

    return {name: value(field) for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def _tensor_kinds(readers: list[GGUFReader]) -> dict[str, GGMLQuantizationType]:
    return {t.name: GGMLQuantizationType(t.tensor_type) for reader in readers for t in reader.tensors}


def hf_config(meta: dict[str, Any], kinds: dict[str, GGMLQuantizationType]) -> dict[str, Any]:
    """The config.json of a DeepSeek-2 GGUF's metadata (llama.cpp's keys, as its converter writes them)."""
    arch = meta.get("general.architecture")
    if arch != ARCHITECTURE:
        raise ValueError(f"GGUF general.architecture is {arch!r}; latentserve reads {ARCHITECTURE!r} (DeepSeek V2/V3)")

    def get(key: str, default: Any = KeyError) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is KeyError:
            raise ValueError(f"GGUF metadata is missing {arch}.{key}")
        return value

    rope_dim = get("rope.dimension_count")
    mla = f"{arch}.attention.key_length_mla" in meta  # the k_b / v_b layout's keys; older files: key_length
    key_length = get("attention.key_length_mla" if mla else "attention.key_length")
    sigmoid = get("expert_gating_func", 1) == 2  # llama.cpp reads a file without it as softmax (V2)
    config = {
        "architectures": ["DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if sigmoid else "deepseek_v2",
        "vocab_size": get("vocab_size", len(meta.get("tokenizer.ggml.tokens", ()))),
        "hidden_size": get("embedding_length"),
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": get("attention.head_count"),
        "q_lora_rank": get("attention.q_lora_rank", 0) or None,  # llama.cpp says 0 for none (V2-Lite)
        "kv_lora_rank": get("attention.kv_lora_rank"),
        "qk_nope_head_dim": key_length - rope_dim,
        "qk_rope_head_dim": rope_dim,
        "v_head_dim": get("attention.value_length_mla" if mla else "attention.value_length"),
        "first_k_dense_replace": get("leading_dense_block_count", 0),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": get("context_length"),
        "rope_theta": get("rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in kinds,
        "num_nextn_predict_layers": 0,  # llama.cpp's converter leaves DeepSeek's MTP layers out
    }
    if get("expert_count", 0):
        config.update(
            n_routed_experts=get("expert_count"), num_experts_per_tok=get("expert_used_count"),
            moe_intermediate_size=get("expert_feed_forward_length"), n_shared_experts=get("expert_shared_count", 0),
            routed_scaling_factor=get("expert_weights_scale", 1.0), norm_topk_prob=get("expert_weights_norm", False),
            scoring_func="sigmoid" if sigmoid else "softmax",
            topk_method="noaux_tc" if sigmoid else ("group_limited_greedy" if get("expert_group_count", 1) > 1
                                                    else "greedy"),
        )
        if get("expert_group_count", None) is not None:
            config.update(n_group=get("expert_group_count"), topk_group=get("expert_group_used_count"))
    if get("rope.scaling.type", "none") == "yarn":
        # The converter writes yarn_log_multiplier = 0.1 * mscale_all_dim, and llama.cpp takes mscale equal to it.
        mscale = get("rope.scaling.yarn_log_multiplier", 0.0) / 0.1
        config["rope_scaling"] = {
            "type": "yarn", "factor": get("rope.scaling.factor"),
            "original_max_position_embeddings": get("rope.scaling.original_context_length"),
            "beta_fast": get("rope.scaling.yarn_beta_fast", 32.0), "beta_slow": get("rope.scaling.yarn_beta_slow", 1.0),
            "mscale": mscale, "mscale_all_dim": mscale,
        }
    linear = [kind for name, kind in kinds.items() if _runs_quantized(name)]
    if any(kind in INT4_TYPES or kind == GGMLQuantizationType.Q4_K for kind in linear):  # 4-bit: an int4 model
        config["quantization_config"] = {"quant_method": "gguf", "method": "int4"}
    elif any(kind not in FLOAT_TYPES for kind in linear):
        config["quantization_config"] = {"quant_method": "gguf", "method": "int8"}
    return config


def _hf_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor that maps one to one (None: experts, k_b / v_b, unknown)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _BLOCK.match(name)
    if match is None or match[2] not in _LAYER_NAMES:
        return None
    return f"model.layers.{match[1]}.{_LAYER_NAMES[match[2]]}"


def _runs_quantized(name: str) -> bool:
    """Whether the GGUF tensor `name` is (part of) a weight latentserve runs as an int8/int4 layer."""
    match = _BLOCK.match(name)
    return (match is not None and match[2] in _EXPERTS) or bool(_QUANTIZED_LAYER.search(_hf_name(name) or ""))


def cache_root() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "latentserve")
    return Path(root).expanduser() / "gguf"


def open_gguf(path: Path) -> Path:
    """A folder standing for the GGUF file `path` (and the rest of its split): config.json, the tokenizer files (where
    its tokenizer can be rebuilt; else a warning and none: prompts then go in as token ids) and `gguf.json` naming
    the files. It is rewritten each time, and keyed by the files' paths, sizes and times."""
    files = [f.resolve() for f in gguf_files(path)]
    key = hashlib.sha256(json.dumps([(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]).encode())
    folder = cache_root() / f"{files[0].stem}-{key.hexdigest()[:16]}"
    readers = [GGUFReader(f) for f in files]
    meta = _metadata(readers[0])
    config = hf_config(meta, _tensor_kinds(readers))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    (folder / GGUF_INDEX).write_text(json.dumps({"files": [str(f) for f in files]}))
    reason = unsupported_reason(meta)
    if reason is None:
        tokenizer, tokenizer_config = build_tokenizer(meta)
        tokenizer.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
    else:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (folder / name).unlink(missing_ok=True)
        logger.warning("%s: its tokenizer is not rebuilt (%s); pass prompts as token ids", path.name, reason)
    return folder


def is_gguf_folder(model_dir: Path) -> bool:
    return (model_dir / GGUF_INDEX).is_file()


def _convert(tensor, hf_name: str, stats: ConversionStats, rows: slice | int | None = None):
    """One GGUF tensor (or one expert's rows of a stacked one) as the loader takes it."""
    kind = GGMLQuantizationType(tensor.tensor_type)
    data = tensor.data if rows is None else tensor.data[rows]
    if _QUANTIZED_LAYER.search(hf_name) and kind in INT4_TYPES:
        stats.repacked[kind.name] += 1
        return int4_weight(np.asarray(data), kind)
    if _QUANTIZED_LAYER.search(hf_name) and kind in _KEPT:
        stats.kept[kind.name] += 1
        return _KEPT[kind](np.asarray(data))
    if _QUANTIZED_LAYER.search(hf_name) and kind not in FLOAT_TYPES:
        stats.requantized[kind.name] += 1
        return int8_weight(np.asarray(data), kind)
    if kind not in FLOAT_TYPES:
        stats.dequantized[kind.name] += 1
    return dequantized(np.asarray(data), kind)


def _experts(layer: str, tensor, up, wanted: Callable[[str], bool],
             stats: ConversionStats) -> Iterator[tuple[str, Any]]:
    """A layer's routed experts from one stacked GGUF tensor, expert by expert; given the layer's `up` tensor beside
    its gate, each expert's gate and up come together: the loader fuses the two, and holds each half until the other
    comes (all of a layer's gates, unpacked, if up followed the whole gate tensor)."""
    for expert in range(tensor.data.shape[0]):
        for stacked in (tensor,) if up is None else (tensor, up):
            name = f"model.layers.{layer}.mlp.experts.{expert}.{_EXPERTS[stacked.name.split('.', 2)[2]]}.weight"
            if wanted(name):
                yield name, _convert(stacked, name, stats, expert)
            release_mapped_pages(stacked.data[expert])
        release_freed_heap()  # the unpacking's temporaries: else a few MiB per expert pile up in glibc's heap


def _kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """kv_b_proj `[heads * (qk_nope + v), kv_lora_rank]` from k_b `[heads, kv_lora_rank, qk_nope]` and v_b
    `[heads, v, kv_lora_rank]`, undoing the converter's split."""
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, k_b.shape[1]).contiguous()


def read_tensors(model_dir: Path, wanted: Callable[[str], bool]) -> Iterator[tuple[str, Any]]:
    """(Hugging Face name, tensor / Int4Weight / Int8Weight / a `FileBlocks` weight: Q6KWeight, Q3KWeight, ...) for
    every `wanted` tensor of the GGUF `model_dir` stands for, one at a time. Each file is memory-mapped while its
    tensors are read, and unmapped after: the pages a mapping touched count as the process's memory until then."""
    files = [Path(f) for f in json.loads((model_dir / GGUF_INDEX).read_text())["files"]]
    # Each file parsed once: GGUFReader reads all the metadata, the vocabulary's 100k strings included (seconds).
    readers = [GGUFReader(file) for file in files]
    for reader in readers:
        # The metadata was open_gguf's to read; here it is only memory (the vocabulary: 100k+ small numpy arrays).
        reader.fields.clear()
    # Some converter versions wrote attn_kv_b beside attn_k_b / attn_v_b: kv_b_proj is then read from attn_kv_b.
    blocks = [_BLOCK.match(t.name) for reader in readers for t in reader.tensors]
    whole_kv_b = {m[1] for m in blocks if m and m[2] == "attn_kv_b.weight"}
    stats, halves = ConversionStats(), {}
    for file in files:
        reader = readers.pop(0)  # this file's reader dropped once its tensors are read: unmapped
        by_name = {t.name: t for t in reader.tensors}
        # The embedding and lm_head first, wherever the file has them: the largest tensors, whose conversion's
        # temporaries (the embedding's fp32 values before the loader casts them) then come while little is loaded.
        for tensor in sorted(reader.tensors, key=lambda t: t.name not in _GLOBAL_NAMES):
            release_freed_heap()  # what unpacking the last tensor freed
            match = _BLOCK.match(tensor.name)
            part = match[2] if match else None
            if part in (_K_B, _V_B) and match[1] in whole_kv_b:
                continue
            if part in _EXPERTS:
                if not (part == _UP_EXPS and f"blk.{match[1]}.{_GATE_EXPS}" in by_name):  # else read with the gate
                    yield from _experts(match[1], tensor, by_name.get(f"blk.{match[1]}.{_UP_EXPS}")
                                        if part == _GATE_EXPS else None, wanted, stats)
                continue
            if part in (_K_B, _V_B):
                name = f"model.layers.{match[1]}.self_attn.kv_b_proj.weight"
                if wanted(name):
                    halves.setdefault(name, {})[part] = _convert(tensor, name, stats)
                    if len(halves[name]) == 2:
                        pair = halves.pop(name)
                        yield name, _kv_b(pair[_K_B], pair[_V_B])
            else:
                name = _hf_name(tensor.name)
                if name is None:
                    raise ValueError(f"{file.name}: tensor {tensor.name!r} has no place in a DeepSeek model")
                if wanted(name):
                    yield name, _convert(tensor, name, stats)
            release_mapped_pages(tensor.data)
    if halves:
        name, pair = next(iter(halves.items()))
        raise ValueError(f"GGUF has {sorted(pair)} but not both attn_k_b and attn_v_b for {name}")
    release_freed_heap()
    if stats.repacked or stats.kept or stats.requantized or stats.dequantized:
        stats.log(files[0].name)


