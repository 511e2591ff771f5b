"""A decode step's DeepSeek attention block, from the input norm to the residual and the MLP's input norm, in one
native call (kernels/attention_block.c) where every piece would run latentserve's kernels anyway: fp32/bf16, int8 or
int4 projections without bias, decode tokens only, few enough that each projection and per-head product takes its
native kernel, the NATIVE decode backend. The kernel chains those same kernels, so the result is the modules' to
the bit; elsewhere the modules run.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from latentserve.attention.decode.native import NativeMQADecodeBackend
from latentserve.kernels import native
from latentserve.layers.linear import NATIVE_HEAD_TOKENS, Linear, native_rows
from latentserve.layers.norm import RMSNorm
from latentserve.layers.quant.int4 import NativeInt4Linear
from latentserve.layers.quant.int8 import NativeInt8Linear

if TYPE_CHECKING:
    from latentserve.models.mla_attention import DeepseekAttention

Norms = tuple[RMSNorm, RMSNorm]  # a layer's input and post-attention norms
Built = tuple[native.MLABlock, int]  # the kernel's view of a layer, and up to how many tokens it runs it


def _projection(layer: nn.Module, dtype: torch.dtype, kernels: native.NativeKernels,
                threads: int) -> tuple[native.Weight, int | None] | None:
    """(the kernel's view of a projection, up to how many rows its layer runs its native kernel (None: any)), or
    None."""
    if type(layer) is Linear:
        w = layer.weight
        if layer.bias is not None or w.dtype != dtype or not w.is_contiguous():
            return None
        rows = native_rows(dtype, layer.in_features, threads, kernels)
        return native.Weight(kind=native.DENSE, w=w.data_ptr()), rows
    if getattr(layer, "bias", True) is not None or getattr(getattr(layer, "kernels", None), "isa", None) != kernels.isa:
        return None  # (the same build loads the same library, whichever object holds it)
    if isinstance(layer, NativeInt8Linear) and layer.out_dtype in (None, dtype):
        return native.Weight(kind=native.INT8_BLOCKS, w=layer.packed.data_ptr()), None
    if isinstance(layer, NativeInt4Linear):
        return native.Weight(kind=native.INT4, w=layer.packed.data_ptr(), group=layer.group_size), None
    return None


def _absorbed(attn: DeepseekAttention, dtype: torch.dtype,
              kernels: native.NativeKernels) -> tuple[native.Weight, native.Weight, int] | None:
    """The per-head products (to the latent, to the values) as `MLAAttention._forward_decode` runs them natively."""
    core, m = attn.attn, attn.attn.mla
    if core.int8_absorbed is not None:
        uk, uv = core.int8_absorbed
        if uk.kernels.isa != kernels.isa or uv.kernels.isa != kernels.isa:
            return None
        return (*(native.Weight(kind=native.INT8_LANES if h.lanes else native.INT8, w=h.q.data_ptr(),
                                scale=h.scale.data_ptr(), qsum=h.qsum.data_ptr()) for h in (uk, uv)), uk.max_tokens)
    weights = (core.W_UK_T, core.W_UV)
    if (any(w is None or w.dtype != dtype or not w.is_contiguous() for w in weights) or m.kv_lora_rank % 16
            or m.v_head_dim % 16):
        return None
    return (*(native.Weight(kind=native.DENSE, w=w.data_ptr()) for w in weights), NATIVE_HEAD_TOKENS)


def build_block(attn: DeepseekAttention, norms: Norms, dtype: torch.dtype, kernels: native.NativeKernels,
                threads: int) -> Built | None:
    """The layer's attention as the kernel reads it, or None where a piece does not run latentserve's kernels."""
    core, m = attn.attn, attn.attn.mla
    all_norms = [*norms, attn.kv_a_layernorm] + ([attn.q_a_layernorm] if attn.q_lora else [])
    if (not isinstance(core.decode_backend, NativeMQADecodeBackend) or m.qk_rope_head_dim > 1024
            or not all(n.weight.dtype == dtype and n.weight.is_contiguous() for n in all_norms)):
        return None
    names = ("q_a", "q_b", "kv_a", "o_proj") if attn.q_lora else ("q_b", "kv_a", "o_proj")
    layers = (attn.q_a_proj, attn.q_b_proj) if attn.q_lora else (attn.q_proj,)
    projections = [_projection(layer, dtype, kernels, threads)
                   for layer in (*layers, attn.kv_a_proj_with_mqa, attn.o_proj)]
    absorbed = _absorbed(attn, dtype, kernels)
    if absorbed is None or any(p is None for p in projections):
        return None
    uk, uv, head_rows = absorbed
    block = native.MLABlock(
        hidden=norms[0].weight.shape[0], heads=m.num_heads, nope=m.qk_nope_head_dim, rope=m.qk_rope_head_dim,
        latent=m.kv_lora_rank, v_dim=m.v_head_dim, q_lora=attn.q_a_proj.out_features if attn.q_lora else 0,
        **{name: weight for name, (weight, _) in zip(names, projections)}, uk=uk, uv=uv,
        input_norm=norms[0].weight.data_ptr(), post_norm=norms[1].weight.data_ptr(),
        q_a_norm=attn.q_a_layernorm.weight.data_ptr() if attn.q_lora else None,
        kv_a_norm=attn.kv_a_layernorm.weight.data_ptr(), eps=norms[0].eps, post_eps=norms[1].eps,
        q_a_eps=attn.q_a_layernorm.eps if attn.q_lora else 0.0, kv_a_eps=attn.kv_a_layernorm.eps, scale=core.scale,
        style=native.ROPE_STYLES.index(attn.rotary_emb.style), bf=int(dtype == torch.bfloat16))
    return block, min([head_rows, *(rows for _, rows in projections if rows is not None)])


def fused_attention(attn: DeepseekAttention, norms: Norms, cos: torch.Tensor, sin: torch.Tensor,
                    hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(h, post_norm(h)) with h = hidden + attn(input_norm(hidden)) in one native call (`norms`: input, post), or
    None where the modules must run it."""
    tokens, dtype = hidden.shape[0], hidden.dtype
    if hidden.device.type != "cpu" or dtype not in native.KERNEL_DTYPES or tokens == 0:
        return None
    if not attn.native_block or not all(type(n) is RMSNorm for n in norms):
        return None  # a module variant the kernel does not compute (an output gate, a gated norm)
    kernels = native.for_this_cpu()
    core = attn.attn
    md = core.checked_metadata(hidden)
    if kernels is None or md.prefill is not None or md.decode is None or md.dsa is not None:
        return None  # (DSA: the kernel attends every position and has no indexer)
    built = _cached_block(attn, norms, dtype, kernels, torch.get_num_threads())
    if built is None or tokens > built[1] or not core.decode_backend.runs_natively(core.kv_cache):
        return None
    d = md.decode
    return native.mla_attention_block(kernels, built[0], hidden.contiguous(), cos.contiguous(), sin.contiguous(),
                                      core.kv_cache, d.block_table, d.query_start_loc, d.seq_lens, md.slot_mapping)


def _module_tensors(attn: DeepseekAttention, norms: Norms) -> list[torch.Tensor]:
    """The parameters and buffers the kernel reads by address (a replaced one rebuilds the view)."""
    modules = [*norms, attn.kv_a_layernorm, attn.kv_a_proj_with_mqa, attn.o_proj]
    modules += [attn.q_a_proj, attn.q_a_layernorm, attn.q_b_proj] if attn.q_lora else [attn.q_proj]
    return [t for module in modules for ts in (module._parameters, module._buffers) for t in ts.values()
            if t is not None]


def _absorbed_tensors(attn: DeepseekAttention) -> list[torch.Tensor]:
    """The absorbed products' weights: plain attributes, so their addresses go in the view's key."""
    core = attn.attn
    return [t for t in (core.W_UK_T, core.W_UV, *(t for h in core.int8_absorbed or () for t in (h.q, h.scale, h.qsum)))
            if t is not None]


def _cached_block(attn: DeepseekAttention, norms: Norms, dtype: torch.dtype, kernels: native.NativeKernels,
                  threads: int) -> Built | None:
    """`build_block`, rebuilt whenever the dtype, the thread count or a weight changed."""
    absorbed = _absorbed_tensors(attn)
    return attn.fused_block.get((dtype, kernels.isa, threads, *(t.data_ptr() for t in absorbed)), lambda: (
        build_block(attn, norms, dtype, kernels, threads), _module_tensors(attn, norms) + absorbed))
