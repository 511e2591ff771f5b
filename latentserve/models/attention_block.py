"""A decode step's DeepSeek attention block, from the input norm to the residual and the MLP's input norm, in one
native call
(kernels/attention_block.c) where every piece would run latentserve's kernels anyway: plain fp32 or bf16 weights,
decode tokens only, few enough that each linear and per-head product takes the native kernel, the NATIVE decode
backend. The kernel chains those same kernels, so the result is the modules' to the bit; elsewhere the modules run.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from latentserve.attention.decode.native import NativeMQADecodeBackend
from latentserve.kernels import native
from latentserve.layers.linear import NATIVE_HEAD_TOKENS, Linear, native_rows
from latentserve.layers.norm import RMSNorm

if TYPE_CHECKING:
    from latentserve.models.deepseek import DeepseekAttention


def _plain(layer: Linear, dtype: torch.dtype) -> bool:
    return type(layer) is Linear and layer.bias is None and layer.weight.dtype == dtype and layer.weight.is_contiguous()


def _tensors(attn: DeepseekAttention, norms: tuple[RMSNorm, RMSNorm]) -> tuple[torch.Tensor | None, ...]:
    """The weights the kernel reads, in `MLABlock`'s order (None for a quantized layer's, which it cannot read)."""
    layers = (attn.q_a_proj, attn.q_a_layernorm, attn.q_b_proj) if attn.q_lora else (attn.q_proj,)
    layers = (norms[0], *layers, attn.kv_a_proj_with_mqa, attn.kv_a_layernorm)
    core = attn.attn
    return (*(getattr(layer, "weight", None) for layer in layers), core.W_UK_T, core.W_UV,
            getattr(attn.o_proj, "weight", None), norms[1].weight)


def build_block(attn: DeepseekAttention, norms: tuple[RMSNorm, RMSNorm], dtype: torch.dtype) -> native.MLABlock | None:
    """The layer's weights as the kernel reads them, or None where a piece is not plain `dtype` (fp32 or bf16).
    `norms`: the layer's input and post-attention norms."""
    core, m = attn.attn, attn.attn.mla
    linears = [attn.q_a_proj, attn.q_b_proj] if attn.q_lora else [attn.q_proj]
    all_norms = [*norms, attn.kv_a_layernorm] + ([attn.q_a_layernorm] if attn.q_lora else [])
    if (any(t is None for t in _tensors(attn, norms)) or core.int8_absorbed is not None or m.kv_lora_rank % 16 or m.v_head_dim % 16
            or m.qk_rope_head_dim > 1024 or not isinstance(core.decode_backend, NativeMQADecodeBackend)
            or not all(_plain(layer, dtype) for layer in [*linears, attn.kv_a_proj_with_mqa, attn.o_proj])
            or not all(n.weight.dtype == dtype and n.weight.is_contiguous() for n in all_norms)
            or core.W_UK_T.dtype != dtype or core.W_UV.dtype != dtype):
        return None
    weights = [t.data_ptr() for t in _tensors(attn, norms)]
    if attn.q_lora:
        input_w, q_a, q_a_norm, q_b, *rest = weights
    else:
        (input_w, q_b, *rest), q_a, q_a_norm = weights, None, None
    kv_a, kv_a_norm, w_uk_t, w_uv, o_proj, post_norm = rest
    input_norm, post = norms
    return native.MLABlock(
        hidden=input_norm.weight.shape[0], heads=m.num_heads, nope=m.qk_nope_head_dim, rope=m.qk_rope_head_dim,
        latent=m.kv_lora_rank, v_dim=m.v_head_dim, q_lora=attn.q_a_proj.out_features if attn.q_lora else 0,
        input_norm=input_w, q_a=q_a, q_a_norm=q_a_norm, q_b=q_b, kv_a=kv_a, kv_a_norm=kv_a_norm, w_uk_t=w_uk_t,
        w_uv=w_uv, o_proj=o_proj, post_norm=post_norm, eps=input_norm.eps, post_eps=post.eps,
        q_a_eps=attn.q_a_layernorm.eps if attn.q_lora else 0.0, kv_a_eps=attn.kv_a_layernorm.eps, scale=core.scale, style=native.ROPE_STYLES.index(attn.rotary_emb.style),
        bf=int(dtype == torch.bfloat16))


def fused_attention(attn: DeepseekAttention, norms: tuple[RMSNorm, RMSNorm], cos: torch.Tensor, sin: torch.Tensor,
                    hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(h, post_norm(h)) with h = hidden + attn(input_norm(hidden)) in one native call (`norms`: input, post), or
    None where the modules must run it."""
    tokens, dtype = hidden.shape[0], hidden.dtype
    if hidden.device.type != "cpu" or dtype not in native.KERNEL_DTYPES or not 0 < tokens <= NATIVE_HEAD_TOKENS:
        return None
    threads = torch.get_num_threads()
    widths = (hidden.shape[1], attn.o_proj.in_features) + ((attn.q_b_proj.in_features,) if attn.q_lora else ())
    if tokens > min(native_rows(dtype, width, threads) for width in widths):
        return None
    kernels = native.for_this_cpu()
    core = attn.attn
    md = core.checked_metadata(hidden)
    if kernels is None or md.prefill is not None or md.decode is None:
        return None
    block = _cached_block(attn, norms, dtype)  # None unless the decode backend is NATIVE
    if block is None or not core.decode_backend.runs_natively(core.kv_cache, md.decode):
        return None
    d = md.decode
    return native.mla_attention_block(kernels, block, hidden.contiguous(), cos.contiguous(), sin.contiguous(),
                                      core.kv_cache, d.block_table, d.query_start_loc, d.seq_lens, md.slot_mapping)


def _cached_block(attn: DeepseekAttention, norms: tuple[RMSNorm, RMSNorm], dtype: torch.dtype) -> native.MLABlock | None:
    """`build_block`, rebuilt whenever a weight was replaced (the kernel must never read a freed tensor)."""
    key = (dtype, *(None if t is None else t.data_ptr() for t in _tensors(attn, norms)))
    if attn.fused_block is None or attn.fused_block[0] != key:
        attn.fused_block = (key, build_block(attn, norms, dtype))
    return attn.fused_block[1]
