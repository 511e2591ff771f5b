"""GGUF files of a tiny random DeepSeek checkpoint, written with gguf's GGUFWriter under the tensor names and metadata
keys llama.cpp's converter (convert_hf_to_gguf.py, DeepseekV2Model) writes for deepseek2: routed experts stacked per
layer, kv_b_proj split into attn_k_b (per head, transposed) and attn_v_b (or kept as attn_kv_b, as older files
are, or both), e_score_correction_bias as exp_probs_b.bias, 1-D tensors in F32."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from safetensors.torch import load_file

from latentserve.models.loader import SINGLE_FILE

# gguf-py quantizes F32, F16, BF16, Q8_0, Q4_0, Q4_1 itself; K-quants it only dequantizes, so their blocks are
# random (valid: finite fp16 super-block scales) and gguf's dequantization is their value. Byte offsets of each
# K-quant block's fp16 super-block scales, and the block size:
K_QUANTS = {T.Q2_K: ((80, 82), 84), T.Q3_K: ((108,), 110), T.Q4_K: ((0, 2), 144), T.Q5_K: ((0, 2), 176),
            T.Q6_K: ((208,), 210)}


def k_quant_blocks(shape: tuple[int, ...], kind: T, gen: np.random.Generator) -> np.ndarray:
    """Random `kind` blocks for a tensor of `shape` (rows a multiple of 256 values): uint8 `[..., bytes per row]`."""
    offsets, size = K_QUANTS[kind]
    blocks = gen.integers(0, 256, (*shape[:-1], shape[-1] // 256, size), dtype=np.uint8)
    for offset in offsets:
        blocks[..., offset:offset + 2] = gen.uniform(0.00002, 0.0001, blocks.shape[:-1] + (1,)).astype(np.float16) \
            .view(np.uint8)
    return blocks.reshape(*shape[:-1], -1)


def encode(w: torch.Tensor, kind: T, gen: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(what GGUF stores for `w` as `kind`, gguf's own dequantization of it)."""
    if kind in K_QUANTS:
        data = k_quant_blocks(tuple(w.shape), kind, gen)
    else:
        data = gguf.quants.quantize(w.numpy().astype(np.float32), kind)
    return data, gguf.quants.dequantize(data, kind)


def _converted(tensors: dict[str, torch.Tensor], config: dict, kv_b: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under llama.cpp's names, in its layout."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, config["num_hidden_layers"])
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, list] = {}
    for name, t in tensors.items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if ".mlp.experts." in name:
            expert, proj = int(name.split(".")[5]), name.split(".")[6]
            experts.setdefault(f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_exps.weight", []).append((expert, t))
            continue
        if name.endswith("kv_b_proj.weight") and kv_b in ("split", "both"):
            heads, nope, v = config["num_attention_heads"], config["qk_nope_head_dim"], config["v_head_dim"]
            k_b, v_b = t.view(heads, nope + v, -1).split([nope, v], dim=1)
            out[f"blk.{layer}.attn_k_b.weight"] = k_b.transpose(1, 2).contiguous()
            out[f"blk.{layer}.attn_v_b.weight"] = v_b.contiguous()
            if kv_b == "split":
                continue
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        base, suffix = name.rsplit(".", 1)
        out[f"{names.get_name(base)}.{suffix}"] = t
    for name, stack in experts.items():
        out[name] = torch.stack([t for _, t in sorted(stack, key=lambda e: e[0])])
    return out


def _metadata(w: gguf.GGUFWriter, config: dict, split_kv_b: bool) -> None:
    rope = config["qk_rope_head_dim"]
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(1 if split_kv_b else config["num_attention_heads"])
    w.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_expert_used_count(config["num_experts_per_tok"])
    w.add_leading_dense_block_count(config["first_k_dense_replace"])
    w.add_vocab_size(config["vocab_size"])
    if config.get("q_lora_rank") is not None:
        w.add_q_lora_rank(config["q_lora_rank"])
    w.add_kv_lora_rank(config["kv_lora_rank"])
    if split_kv_b:
        w.add_key_length(config["kv_lora_rank"] + rope)
        w.add_value_length(config["kv_lora_rank"])
        w.add_key_length_mla(config["qk_nope_head_dim"] + rope)
        w.add_value_length_mla(config["v_head_dim"])
    else:
        w.add_key_length(config["qk_nope_head_dim"] + rope)
        w.add_value_length(config["v_head_dim"])
    w.add_expert_feed_forward_length(config["moe_intermediate_size"])
    w.add_expert_count(config["n_routed_experts"])
    w.add_expert_shared_count(config["n_shared_experts"])
    w.add_expert_weights_scale(config["routed_scaling_factor"])
    if config.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    sigmoid = config["model_type"] == "deepseek_v3"
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)
    if config.get("n_group"):
        w.add_expert_group_count(config["n_group"])
        w.add_expert_group_used_count(config["topk_group"])
    w.add_rope_dimension_count(rope)
    params = config["rope_parameters"]
    if params.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(params["factor"])
        w.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * params["mscale_all_dim"])


def add_tokenizer(w: gguf.GGUFWriter, tokenizer_dir: Path, pre: str = "gpt-2") -> None:
    """The tokenizer of `tokenizer_dir` as the converter's _set_vocab_gpt2 writes it."""
    raw = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    tokenizer_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    vocab = raw["model"]["vocab"]
    for added in raw["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])]
    special = {a["content"] for a in raw["added_tokens"] if a["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in raw["model"]["merges"]])
    w.add_bos_token_id(vocab[tokenizer_config["bos_token"]])
    w.add_eos_token_id(vocab[tokenizer_config["eos_token"]])
    w.add_add_bos_token(True)
    w.add_chat_template(tokenizer_config["chat_template"])


def write_gguf(src: Path, dst: Path, kind_of: Callable[[str, torch.Tensor], T] = lambda name, t: T.F32,
               kv_b: str = "split", split_max_tensors: int = 0, tokenizer_dir: Path | None = None,
               seed: int = 0, skip: set[str] = frozenset()) -> dict[str, np.ndarray]:
    """Write `src` (a safetensors checkpoint) as the GGUF `dst`: kv_b_proj as attn_k_b and attn_v_b ("split"),
    attn_kv_b ("whole", older files) or all three ("both", as some converter versions wrote); each 2-D+ tensor as
    `kind_of(gguf name, tensor)` (1-D ones F32, as the converter does), but those in `skip`. Returns gguf's
    dequantization of every tensor, by GGUF name."""
    config = json.loads((src / "config.json").read_text())
    tensors = _converted(load_file(src / SINGLE_FILE), config, kv_b)
    w = gguf.GGUFWriter(dst, "deepseek2", split_max_tensors=split_max_tensors)
    _metadata(w, config, kv_b != "whole")
    if tokenizer_dir is not None:
        add_tokenizer(w, tokenizer_dir)
    gen = np.random.default_rng(seed)
    values = {}
    for name, t in tensors.items():
        if name in skip:
            continue
        kind = T.F32 if t.dim() == 1 else kind_of(name, t)
        data, values[name] = encode(t.float(), kind, gen)
        w.add_tensor(name, data, raw_dtype=kind if kind not in (T.F32, T.F16) else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return values
