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
from latentserve.layers.norm import RMSNorm

if TYPE_CHECKING:
    from latentserve.models.mla_attention import DeepseekAttention

Norms = tuple[RMSNorm, RMSNorm]  # a layer's input and post-attention norms
Built = tuple[native.MLABlock, int]  # the kernel's view of a layer, and up to how many tokens it runs it


def _projection(layer: nn.Module, dtype: torch.dtype,
                kernels: native.NativeKernels) -> tuple[native.Weight, int | None] | None:
    """The layer's own descriptor (`native_weight`: what the kernel reads, up to how many rows its layer runs it,
    None: any), or None where the layer is not one of latentserve's kernels."""
    describe = getattr(layer, "native_weight", None)
    return None if describe is None else describe(dtype, kernels)


def build_block(attn: DeepseekAttention, norms: Norms, dtype: torch.dtype) -> Built | None:
    """The layer's attention as the kernel reads it, chained from its modules' own descriptors (each chosen once
    from the loader's `KernelPolicy`), or None where a piece does not run latentserve's kernels."""
    core, m = attn.attn, attn.attn.mla
    kernels = core.kernels
    all_norms = [*norms, attn.kv_a_layernorm] + ([attn.q_a_layernorm] if attn.q_lora else [])
    if (kernels is None or not isinstance(core.decode_backend, NativeMQADecodeBackend)
            or m.qk_rope_head_dim > native.abi.MAX_ROPE
            or not all(n.weight.dtype == dtype and n.weight.is_contiguous() for n in all_norms)):
        return None
    names = ("q_a", "q_b", "kv_a", "o_proj") if attn.q_lora else ("q_b", "kv_a", "o_proj")
    layers = (attn.q_a_proj, attn.q_b_proj) if attn.q_lora else (attn.q_proj,)
    projections = [_projection(layer, dtype, kernels) for layer in (*layers, attn.kv_a_proj_with_mqa, attn.o_proj)]
    absorbed = core.native_products(dtype)
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


def native_block(attn: DeepseekAttention, norms: Norms, dtype: torch.dtype) -> Built | None:
    """The layer's attention block as the kernel reads it for `dtype` activations (cached in `attn.fused_block`:
    built once after the weights are loaded and again only when one is replaced), or None where the modules run
    it."""
    if not attn.native_block or not all(type(n) is RMSNorm for n in norms):
        return None  # a module variant the kernel does not compute (an output gate, a gated norm)
    if dtype not in native.KERNEL_DTYPES or attn.attn.kernels is None:
        return None
    return _cached_block(attn, norms, dtype)


def fused_attention(attn: DeepseekAttention, norms: Norms, cos: torch.Tensor, sin: torch.Tensor,
                    hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(h, post_norm(h)) with h = hidden + attn(input_norm(hidden)) in one native call (`norms`: input, post), or
    None where the modules must run it."""
    tokens = hidden.shape[0]
    if hidden.device.type != "cpu" or tokens == 0:
        return None
    built = native_block(attn, norms, hidden.dtype)
    if built is None or tokens > built[1]:
        return None
    core = attn.attn
    md = core.checked_metadata(hidden)
    if md.prefill is not None or md.decode is None or md.dsa is not None:
        return None  # (DSA: the kernel attends every position and has no indexer)
    if not core.decode_backend.runs_natively(core.kv_cache):
        return None
    d = md.decode
    return native.mla_attention_block(core.kernels, built[0], hidden.contiguous(), cos.contiguous(), sin.contiguous(),
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


def _cached_block(attn: DeepseekAttention, norms: Norms, dtype: torch.dtype) -> Built | None:
    """`build_block`, rebuilt whenever the dtype or a weight changed."""
    absorbed = _absorbed_tensors(attn)
    return attn.fused_block.get((dtype, *(t.data_ptr() for t in absorbed)), lambda: (
        build_block(attn, norms, dtype), _module_tensors(attn, norms) + absorbed))
