"""latentserve's own CPU kernels, called through ctypes (qgemm.c, int4.c, q6k.c, q45.c, quant_blocks.c: quantized
linears; experts.c: the experts in every format; gemv.c: fp32/bf16 linears for few rows; mla_decode.c: decode
attention over the paged cache; prefill_attention.c: prefill's attention over expanded keys and values; norm.c:
RMSNorm; prologue.c: MLA's latent norm, RoPE and cache write; attention_block.c: a decode step's whole MLA attention
block; route.c: MoE routing; moe_block.c: a decode step's whole MoE block; decode_layers.c: a decode step's run of
decoder layers, both blocks of each; argmax.c: the sampler's argmax). Built and loaded by build.py; the interface is
latentserve.h, mirrored by abi.py; every wrapper checks what it passes first (checks.py's boundary rule) and passes
tensors as descriptors.

The wrappers, one module a room: `linear.py` (int8, int4, Q6_K, Q3_K, Q2_K, Q5_0, Q5_1, Q5_K, Q4_K and dense linears,
MLA's per-head products, RMSNorm, argmax), `attention.py` (MLA's prologue, decode and prefill attention, a decode step's
attention block), `moe.py` (routing, the experts, a decode step's MoE block), `layers.py` (a decode step's run of
decoder layers), `packing.py` (the quantized weights' layouts), `calls.py` (what they share). Callers reach all of them,
the kernels and their build through this package: `native.int8_linear`, `native.native_kernels`.
"""
from latentserve.kernels import abi  # noqa: F401
from latentserve.kernels.abi import (DENSE, INT4, INT8, INT8_BLOCKS, INT8_LANES, Q2K, Q3K, Q4K, Q5K,  # noqa: F401
                                     Q6K, Q50, Q51, ROPE_STYLES, ExpertTable, MLABlock, MoEBlock, Weight, desc)
from latentserve.kernels.build import (CACHE_ENV, FALLBACK, NATIVE_ENV, NativeKernels,  # noqa: F401
                                       kernel_isa, load, native_kernels, runnable_isas)
from latentserve.kernels.native.attention import (mla_attention_block, mla_decode, mla_prologue,  # noqa: F401
                                                  prefill_attention)
from latentserve.kernels.native.calls import KERNEL_DTYPES, KV_CACHE_DTYPES, PROFILE_PREFIX, activations  # noqa: F401
from latentserve.kernels.native.layers import LayerStack, decode_layers  # noqa: F401
from latentserve.kernels.native.linear import (argmax, dense_heads, dense_linear, int4_linear, int8_heads,  # noqa: F401
                                               int8_heads_lanes, int8_linear, q2k_linear, q3k_linear, q4k_linear,
                                               q5k_linear, q6k_linear, q50_linear, q51_linear, rms_norm)
from latentserve.kernels.native.moe import (DENSE_FORMATS, Experts, Format, expert_table, experts,  # noqa: F401
                                            moe_block, route)
from latentserve.kernels.native.packing import (Q2K_FORMAT, Q3K_FORMAT, Q4K_FORMAT, Q5K_FORMAT,  # noqa: F401
                                                Q6K_FORMAT, Q50_FORMAT, Q51_FORMAT, int8_lanes, pack_int4, pack_int8,
                                                pack_q2k, pack_q3k, pack_q4k, pack_q5k, pack_q6k, pack_q50, pack_q51,
                                                unpack_int8)
