"""`make demo` until the embedded model lands: one MLA layer, a mixed batch, checked against naive math."""
from __future__ import annotations

import torch

from latentserve.attention.builder import MLAMetadataBuilder
from latentserve.attention.kv_cache import allocate_kv_caches, slots_for_positions
from latentserve.attention.metadata import CommonAttentionMetadata
from latentserve.attention.mla import MLAAttention
from latentserve.config import AttentionConfig, MLAConfig
from latentserve.forward_context import ForwardContext, StaticForwardContext, set_forward_context


def main() -> None:
    torch.manual_seed(0)
    mla = MLAConfig(num_heads=8, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
    config = AttentionConfig(block_size=16)
    static_ctx = StaticForwardContext()
    layer = MLAAttention("demo.attn", mla, mla.qk_head_dim**-0.5, config, static_ctx)
    layer.process_weights_after_loading()
    cache = allocate_kv_caches(static_ctx, 32, config.block_size, torch.float32)["demo.attn"]
    # two decodes over 40 and 70 cached tokens, then a 25-token prefill with no context
    query_lens, seq_lens = [1, 1, 25], [41, 71, 25]
    block_table = torch.arange(3 * 5, dtype=torch.int32).view(3, 5)
    slots = torch.cat([
        slots_for_positions(block_table[r], torch.arange(s - q, s), config.block_size)
        for r, (q, s) in enumerate(zip(query_lens, seq_lens))
    ])
    cache.normal_()
    common = CommonAttentionMetadata.from_lists(query_lens, seq_lens, block_table, slots)
    builder = MLAMetadataBuilder(["demo.attn"], static_ctx, mla, config)
    md = builder.build(common)
    q = torch.randn(27, mla.num_heads, mla.qk_head_dim)
    kv_c, k_pe = torch.randn(27, mla.kv_lora_rank), torch.randn(27, mla.qk_rope_head_dim)
    with set_forward_context(ForwardContext({"demo.attn": md})):
        out = layer(q, kv_c, k_pe)
    print(f"MLA layer: {md.num_decodes} decodes + {md.num_prefills} prefill -> output {tuple(out.shape)}")
    print(f"prefill backend {type(md.prefill.backend).__name__} (a clone owned by {builder}),"
          f" decode backend {type(layer.decode_backend).__name__}")
    print(f"KV cache per token per layer: {mla.kv_cache_dim} values ({mla.kv_cache_dim * 4} bytes in fp32)")


if __name__ == "__main__":
    main()
