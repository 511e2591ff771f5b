"""The bytes of weights one batch-1 decode token reads, counted from a loaded DeepSeek model's own tensors.

One token reads its embedding row; per layer the attention's projections, norms and absorbed per-head products (the
int8 copies where the layer has them: decode reads those, not the full-precision W_UK / W_UV; kv_b_proj is read by
prefill only), and its MLP: a dense layer's whole MLP, or the MoE's router, shared experts and `num_experts_per_tok`
routed experts (the layer's mean expert, as stored); then the final norm and lm_head. The KV cache rows it attends
are not weights and are not counted.
"""
from __future__ import annotations

from typing import Iterable

import torch
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
