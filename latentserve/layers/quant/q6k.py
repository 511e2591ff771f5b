"""llama.cpp's 16-column k-quants as the file holds them, all run by kernels/q6k.c: Q6_K (a GGUF's `Q6KWeight`), w = d
* sc * (q - 32), an fp16 d per 256 input columns, an int8 sub-scale sc per 16, q in [0, 63]: 6.5625 bits a weight
(6.625 in the kernel's layout); Q3_K (`Q3KWeight`), w = d * sc * (q - 4), sc the file's 6-bit scale less 32, q in
[0, 7]: 3.4375 bits (3.625 in the kernel's layout); Q2_K (`Q2KWeight`), w = d * sc * q - dmin * m, an fp16 d and dmin
per 256, a 4-bit sc and m per 16, q in [0, 3]: 2.625 bits (2.75 in the kernel's layout). As int8 per row each reads 8
bits and its values are rounded again.
"""
from __future__ import annotations

from latentserve.kernels import native
from latentserve.layers.quant.file_blocks import NativeFileBlocksLinear
from latentserve.layers.quant.prequantized import KQUANT_COLUMNS, Q6K_D_COLUMNS


class NativeQ6KLinear(NativeFileBlocksLinear):
    """latentserve's Q6_K kernel (`native.pack_q6k`'s layout) at every row count."""

    kernel, weight_kind, group = "latentserve q6_k", native.Q6K, 16
    expert_format = native.Q6K_FORMAT
    file_type, columns = "Q6_K", Q6K_D_COLUMNS
    read = "6.625 bits a weight read; int8 per row reads 8 and rounds the values again"
    pack, linear = staticmethod(native.pack_q6k), staticmethod(native.q6k_linear)


class NativeQ3KLinear(NativeFileBlocksLinear):
    """latentserve's Q3_K kernel (`native.pack_q3k`'s layout) at every row count."""

    kernel, weight_kind, group = "latentserve q3_k", native.Q3K, 16
    expert_format = native.Q3K_FORMAT
    file_type, columns = "Q3_K", Q6K_D_COLUMNS
    read = "3.625 bits a weight read; int8 per row reads 8 and rounds the values again"
    pack, linear = staticmethod(native.pack_q3k), staticmethod(native.q3k_linear)


class NativeQ2KLinear(NativeFileBlocksLinear):
    """latentserve's Q2_K kernel (`native.pack_q2k`'s layout) at every row count."""

    kernel, weight_kind, group = "latentserve q2_k", native.Q2K, 16
    expert_format = native.Q2K_FORMAT
    file_type, columns = "Q2_K", KQUANT_COLUMNS
    read = "2.75 bits a weight read; int8 per row reads 8 and rounds the values again"
    pack, linear = staticmethod(native.pack_q2k), staticmethod(native.q2k_linear)
