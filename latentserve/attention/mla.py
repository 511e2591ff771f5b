"""`MLAAttention`: the attention of one MLA layer over its paged latent cache."""
from __future__ import annotations

import torch
from torch import nn

from latentserve import batch_invariant
from latentserve.attention.backend import SelectorConfig
from latentserve.attention.decode.selector import get_mla_decode_backend
from latentserve.attention.kv_cache import dequantize_rows, gather_kv_cache, write_kv_cache
from latentserve.attention.merge import merge_attn_states
from latentserve.attention.metadata import MLADecodeMetadata, MLAMetadata, MLAPrefillMetadata
from latentserve.attention.prefill.base import OwnershipError
from latentserve.attention.prefill.selector import get_mla_prefill_backend
from latentserve.config import AttentionConfig, MLAConfig
from latentserve.forward_context import StaticForwardContext, get_forward_context
from latentserve.kernels import native
from latentserve.kernels.native import KERNEL_DTYPES, KV_CACHE_DTYPES, NativeKernels
from latentserve.kernels.policy import KernelPolicy, default_policy
from latentserve.layers.linear import Linear, head_products
from latentserve.layers.norm import RMSNorm
from latentserve.layers.quant.heads import Int8HeadProducts
from latentserve.layers.rotary import RotaryEmbedding


class MLAAttention(nn.Module):
    """Takes projected queries and latents, returns per-head values `[T, N*V]` (before o_proj).

    Decode tokens go through the absorbed MQA path over the cache; prefill tokens through the
    expanded MHA path, with cached context read chunk by chunk and merged by log-sum-exp.
    """

    def __init__(
        self,
        layer_name: str,
        mla: MLAConfig,
        scale: float,
        attn_config: AttentionConfig,
        static_ctx: StaticForwardContext,
        kv_cache_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window <= 0):
            raise ValueError(f"{layer_name}: sliding_window must be a positive int or None, got {sliding_window!r}")
        self.layer_name = layer_name
        self.mla = mla
        self.scale = scale
        self.kv_cache_dtype = kv_cache_dtype
        self.debug = attn_config.debug_ownership
        self.kv_b_proj = Linear(
            mla.kv_lora_rank, mla.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False, device=device
        )
        self.sliding_window = sliding_window
        selector_config = SelectorConfig(
            kv_cache_dtype, mla.num_heads, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim,
            sliding_window,
        )
        prefill_cls = get_mla_prefill_backend(device, selector_config, attn_config.prefill_backend)
        decode_cls = get_mla_decode_backend(device, selector_config, attn_config.decode_backend)
        # A prototype only: metadata builders run clones of it, never this instance.
        self.prefill_backend = prefill_cls(
            mla.num_heads, scale, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim,
            attn_config, sliding_window=sliding_window,
        )
        self.decode_backend = decode_cls(mla.num_heads, scale, mla.kv_lora_rank, mla.qk_rope_head_dim, attn_config,
                                         sliding_window=sliding_window)
        self.kv_cache: torch.Tensor | None = None
        # The layer whose latent cache this one reads and never writes (Mistral Large 4's shared KV): its cache is
        # bound here too (allocate_kv_caches) and this layer has none of its own; None: its own cache.
        self.kv_source: str | None = None
        # Extra per-layer caches on the same block table, name -> values per token (DSA's indexer keys).
        self.extra_cache_dims: dict[str, int] = {}
        self.extra_caches: dict[str, torch.Tensor] = {}
        # DSA layers attend each token's top-k positions (the builders then build `MLAMetadata.dsa`); None: dense.
        self.index_topk: int | None = None
        self.W_UK_T: torch.Tensor | None = None
        self.W_UV: torch.Tensor | None = None
        # (q_nope -> latent, latent -> values) in int8 for few decode tokens, under int8/int4 weights.
        self.int8_absorbed: tuple[Int8HeadProducts, Int8HeadProducts] | None = None
        # latentserve's kernels for the prologue and the absorbed products, and up to how many tokens those products
        # take them: asked once, in process_weights_after_loading.
        self.kernels: NativeKernels | None = None
        self.head_tokens = 0
        static_ctx.register(layer_name, self)

    def process_weights_after_loading(self, policy: KernelPolicy | None = None, int8_absorbed: bool = False) -> None:
        """Choose the layer's kernels from `policy` (None: the default one), and split kv_b_proj into the absorbed
        decode weights W_UK_T `[N, P, L]` and W_UV `[N, L, V]`, with their int8 copies where `int8_absorbed` (int8 /
        int4 weights) and the policy has kernels."""
        policy = policy or default_policy()
        self.kernels, self.head_tokens = policy.kernels, policy.head_tokens
        if self.W_UK_T is not None:
            return  # split once (a saved model maps them)
        int8_kernels = policy.kernels if int8_absorbed and self.kv_b_proj.weight.device.type == "cpu" else None
        m = self.mla
        w = self.kv_b_proj.weight.detach().view(m.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        self.W_UK_T = w[:, : m.qk_nope_head_dim, :].contiguous()
        self.W_UV = w[:, m.qk_nope_head_dim :, :].transpose(1, 2).contiguous()
        if int8_kernels is not None:
            self.int8_absorbed = (Int8HeadProducts(self.W_UK_T.transpose(1, 2).float(), int8_kernels),
                                  Int8HeadProducts(self.W_UV.transpose(1, 2).float(), int8_kernels))

    def native_products(self, dtype: torch.dtype) -> tuple[native.Weight, native.Weight, int] | None:
        """The absorbed per-head products (to the latent, to the values) as a one-call block reads them, and up to
        how many tokens `_forward_decode` runs them on latentserve's kernels; None where it does not."""
        if self.kernels is None:
            return None
        if self.int8_absorbed is not None:
            uk, uv = self.int8_absorbed
            return uk.native_weight(), uv.native_weight(), uk.max_tokens
        weights, m = (self.W_UK_T, self.W_UV), self.mla
        if (any(w is None or w.dtype != dtype or not w.is_contiguous() for w in weights) or m.kv_lora_rank % 16
                or m.v_head_dim % 16):
            return None
        return (*(native.Weight(kind=native.DENSE, w=w.data_ptr()) for w in weights), self.head_tokens)

    def forward(self, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
        """q `[T, N, P+R]`, kv_c_normed `[T, L]`, k_pe `[T, R]` (rope applied) -> `[T, N*V]`."""
        md = self.checked_metadata(q)
        if self.kv_source is None:
            write_kv_cache(self.kv_cache, kv_c_normed, k_pe, md.slot_mapping)
        return self._attend(q, kv_c_normed, k_pe, md)

    def read_new_rows(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """A reading layer's (`kv_source`) latents and rotated rope keys `[T, L]`, `[T, R]` in `dtype` of this
        ubatch's tokens, as the source layer, earlier in the model, wrote them (a quantized cache's dequantized)."""
        md = self._metadata()
        rows = gather_kv_cache(self.kv_cache, md.slot_mapping.clamp(min=0))  # (padding: any row, unused)
        rows = dequantize_rows(rows, self.mla.kv_lora_rank, dtype)
        return rows.split([self.mla.kv_lora_rank, self.mla.qk_rope_head_dim], dim=-1)

    def forward_projected(self, q: torch.Tensor, kv: torch.Tensor, latent_norm: RMSNorm, rotary: RotaryEmbedding,
                          cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
        """`forward` from the kv_a projection kv `[T, L+R]` and q with its rope dims not yet rotated (cos, sin `[T,
        R]` from `rotary.cos_sin`): the latent's norm, both rotations and the cache write in one native call
        (kernels/prologue.c, to the bit what the torch ops give). None where the kernels cannot take it: the caller
        then runs those ops and `forward`."""
        dtype = kv.dtype
        if (self.kv_source is not None or kv.device.type != "cpu" or dtype not in KERNEL_DTYPES or q.dtype != dtype
                or latent_norm.weight.dtype != dtype or self.kv_cache is None
                or self.kv_cache.dtype not in KV_CACHE_DTYPES):
            return None
        if self.kernels is None:
            return None
        md = self.checked_metadata(q)
        kv_c_normed, k_pe = native.mla_prologue(self.kernels, q, kv, latent_norm.weight, latent_norm.eps, cos, sin,
                                                rotary.style, self.kv_cache, md.slot_mapping)
        return self._attend(q, kv_c_normed, k_pe, md)

    def checked_metadata(self, q: torch.Tensor) -> MLAMetadata:
        """This layer's metadata in the forward context, checked against the cache binding and q's token count."""
        if self.kv_cache is None or self.W_UK_T is None:
            raise RuntimeError(f"{self.layer_name}: bind a KV cache and call process_weights_after_loading() first")
        md = self._metadata()
        if q.shape[0] != md.num_actual_tokens:
            raise ValueError(f"{self.layer_name}: got {q.shape[0]} tokens but the metadata describes "
                             f"{md.num_actual_tokens}")
        return md

    def _attend(self, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, md: MLAMetadata) -> torch.Tensor:
        """The attention proper, the tokens' latents already in the cache."""
        num_tokens, nd = md.num_actual_tokens, md.num_decode_tokens
        if md.prefill is None and md.decode is not None:
            return self._forward_decode(q, md.decode).flatten(1)
        if md.decode is None and md.prefill is not None:
            return self._forward_prefill(q, kv_c_normed, k_pe, md.prefill).flatten(1)
        out = q.new_empty(num_tokens, self.mla.num_heads, self.mla.v_head_dim)  # both kinds, or none at all
        if md.decode is not None:
            out[:nd] = self._forward_decode(q[:nd], md.decode)
            out[nd:] = self._forward_prefill(q[nd:], kv_c_normed[nd:], k_pe[nd:], md.prefill)
        return out.flatten(1)

    def _metadata(self) -> MLAMetadata:
        ctx = get_forward_context()
        md = ctx.attn_metadata.get(self.layer_name)
        if md is None:
            raise RuntimeError(f"no attention metadata for layer {self.layer_name!r} in the forward context")
        if self.debug and ctx.ubatch_id is not None and md.builder_id != ctx.ubatch_id:
            raise OwnershipError(
                f"{self.layer_name}: ubatch {ctx.ubatch_id} is reading metadata built for ubatch {md.builder_id}"
            )
        return md

    def _up_project(self, kv_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.mla
        kv = self.kv_b_proj(kv_c).view(-1, m.num_heads, m.qk_nope_head_dim + m.v_head_dim)
        return kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)

    def _expand_keys(self, kv_c: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k_nope, v = self._up_project(kv_c)
        k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, self.mla.num_heads, -1)], dim=-1)
        return k, v

    def _forward_prefill(
        self, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, md: MLAPrefillMetadata
    ) -> torch.Tensor:
        backend = md.backends[self.layer_name]
        backend.check_prepared_for(md)
        k, v = self._expand_keys(kv_c, k_pe)
        chunked = md.chunked_context
        if chunked is None:
            return backend.run_prefill_new_tokens(q, k, v, return_softmax_lse=False)
        out, lse = backend.run_prefill_new_tokens(q, k, v, return_softmax_lse=True)
        for i, slots in enumerate(chunked.slots):
            if not self._chunk_in_window(i, md):
                continue  # no query sees it: its merge would change nothing, its gather and up-projection cost
            rows = dequantize_rows(gather_kv_cache(self.kv_cache, slots, out=chunked.workspace),
                                   self.mla.kv_lora_rank, q.dtype)
            ctx_k, ctx_v = self._expand_keys(*rows.split([self.mla.kv_lora_rank, self.mla.qk_rope_head_dim], dim=-1))
            ctx_out, ctx_lse = backend.run_prefill_context_chunk(i, q, ctx_k, ctx_v)
            out, lse = merge_attn_states(ctx_out, ctx_lse, out, lse)
        return out

    def _chunk_in_window(self, chunk_idx: int, md: MLAPrefillMetadata) -> bool:
        """Whether some prefill query sees a key of context chunk `chunk_idx` (always, without a sliding window)."""
        if self.sliding_window is None:
            return True
        start = chunk_idx * md.chunked_context.chunk_size
        # A request's first query, at position ctx, sees keys from ctx - W + 1 on; its chunk keys end at `end` - 1.
        return any(min(start + md.chunked_context.chunk_size, ctx) - 1 >= ctx - self.sliding_window + 1
                   for ctx in md.context_lens_cpu if ctx > start)

    def _forward_decode(self, q: torch.Tensor, md: MLADecodeMetadata) -> torch.Tensor:
        q_nope, q_pe = q.split([self.mla.qk_nope_head_dim, self.mla.qk_rope_head_dim], dim=-1)
        few = q.shape[0] <= Int8HeadProducts.max_tokens or batch_invariant.is_enabled()
        if self.int8_absorbed is not None and few:
            to_latent, to_values = self.int8_absorbed
            o_latent = self.decode_backend.forward(torch.cat([to_latent(q_nope), q_pe], dim=-1), self.kv_cache, md)
            return to_values(o_latent)
        q_latent = head_products(q_nope, self.W_UK_T, self.kernels, self.head_tokens)
        o_latent = self.decode_backend.forward(torch.cat([q_latent, q_pe], dim=-1), self.kv_cache, md)
        return head_products(o_latent, self.W_UV, self.kernels, self.head_tokens)
