"""The bytes of weights one batch-1 decode token reads, counted from a loaded DeepSeek model's own tensors.

One token reads its embedding row; per layer the attention's projections, norms and absorbed per-head products (the
int8 copies where the layer has them: decode reads those, not the full-precision W_UK / W_UV; kv_b_proj is read by
prefill only), and its MLP: a dense layer's whole MLP, or the MoE's router, shared experts and `num_experts_per_tok`
routed experts (the layer's mean expert, as stored); then the final norm and lm_head. The KV cache rows it attends
are not weights and are not counted.

`gguf_decode_bytes` counts the same parts from a GGUF file's own tensors, as llama.cpp-family engines read them at
their stored size: the peer's side of the bandwidth comparison.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable

import torch
from gguf import GGUFReader
from torch import nn

from latentserve.layers.moe import MoE
from latentserve.models.deepseek import DeepseekForCausalLM
from latentserve.models.mla_attention import DeepseekAttention


def _tensors(modules: Iterable[nn.Module]) -> list[torch.Tensor]:
    return [t for m in modules for t in (*m.parameters(), *m.buffers())]


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of distinct tensors (a tensor shared by two modules, as tied weights, counts once)."""
    return sum(nbytes for _, nbytes in {(t.data_ptr(), t.nbytes) for t in tensors})


def attention_bytes(attn: DeepseekAttention) -> int:
    core = attn.attn
    projections = [attn.q_a_proj, attn.q_a_layernorm, attn.q_b_proj] if attn.q_lora else [attn.q_proj]
    tensors = _tensors([*projections, attn.kv_a_proj_with_mqa, attn.kv_a_layernorm, attn.o_proj])
    if core.int8_absorbed is not None:
        tensors += [t for products in core.int8_absorbed for t in (products.q, products.scale, products.qsum)]
    else:
        tensors += [core.W_UK_T, core.W_UV]
    return _nbytes(tensors)


def mlp_bytes(mlp: nn.Module) -> int:
    """A dense MLP's bytes, or a MoE's router + shared experts + its top-k routed experts' (mean expert) bytes."""
    if not isinstance(mlp, MoE):
        return _nbytes(_tensors([mlp]))
    shared = [] if mlp.shared_experts is None else [mlp.shared_experts]
    routed = sum(_nbytes(_tensors([e])) for e in mlp.experts) / len(mlp.experts)
    return _nbytes(_tensors([mlp.gate, *shared])) + round(mlp.gate.cfg.num_experts_per_tok * routed)


def decode_bytes_per_token(model: DeepseekForCausalLM) -> dict[str, int]:
    """{part: bytes} one batch-1 decode token reads: embedding, attention, MLP/MoE, norms, final norm, lm_head."""
    inner = model.model
    layers = list(inner.layers)
    unsupported = [type(layer.self_attn).__name__ for layer in layers if type(layer.self_attn) is not DeepseekAttention]
    if unsupported:
        raise ValueError(f"decode bytes are counted for DeepSeek MLA layers only, not {sorted(set(unsupported))}")
    return {
        "embedding row": inner.embed_tokens.weight[0].nbytes,
        "attention": sum(attention_bytes(layer.self_attn) for layer in layers),
        "layer norms": _nbytes(_tensors([m for layer in layers
                                         for m in (layer.input_layernorm, layer.post_attention_layernorm)])),
        "MLP / MoE": sum(mlp_bytes(layer.mlp) for layer in layers),
        "final norm": _nbytes(_tensors([inner.norm])),
        "lm_head": _nbytes(_tensors([model.lm_head])),
    }


_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_NORMS = ("attn_norm", "ffn_norm")


def _gguf_part(kind: str, split_kv_b: bool) -> str | None:
    """Which decode_bytes_per_token part a layer tensor `kind` (e.g. "attn_q_a", "ffn_up_exps") belongs to; None where
    batch-1 decode does not read it (the whole kv_b where the file also holds its split halves)."""
    if kind in _NORMS:
        return "layer norms"
    if kind == "attn_kv_b" and split_kv_b:
        return None
    return "attention" if kind.startswith("attn_") else "MLP / MoE"


def gguf_decode_bytes(path: Path) -> dict[str, int]:
    """{part: bytes} one batch-1 decode token reads from the GGUF file `path` at its stored types: the parts of
    decode_bytes_per_token, a layer's routed experts (`ffn_*_exps`, stacked) counted as many as the file's
    `expert_used_count`."""
    reader = GGUFReader(path)
    tensors, fields = reader.tensors, reader.fields
    architecture = fields["general.architecture"].contents()
    experts_per_token = int(fields[f"{architecture}.expert_used_count"].contents())
    layers = {m[1]: set() for t in tensors if (m := _LAYER.match(t.name))}
    for t in tensors:
        if m := _LAYER.match(t.name):
            layers[m[1]].add(m[2])
    out = dict.fromkeys(("embedding row", "attention", "layer norms", "MLP / MoE", "final norm", "lm_head"), 0)
    for t in tensors:
        if t.name == "token_embd.weight":
            out["embedding row"] += int(t.n_bytes) // int(t.shape[-1])  # GGUF shapes list the row length first
        elif t.name.startswith("output_norm."):
            out["final norm"] += int(t.n_bytes)
        elif t.name == "output.weight":
            out["lm_head"] += int(t.n_bytes)
        elif m := _LAYER.match(t.name):
            part = _gguf_part(m[2], {"attn_k_b", "attn_v_b"} <= layers[m[1]])
            if part is None:
                continue
            routed = m[2].endswith("_exps")  # [experts] is the last of GGUF's shape
            out[part] += int(t.n_bytes) * experts_per_token // int(t.shape[-1]) if routed else int(t.n_bytes)
        else:
            raise ValueError(f"{path}: tensor {t.name} is not one decode_bytes knows the part of")
    return out
