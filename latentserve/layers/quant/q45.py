"""llama.cpp's 4- and 5-bit weights as a GGUF holds them, for latentserve's kernels on their blocks: Q5_0
(`Q50Weight`, w = d * (q - 16), an fp16 d per 32 input columns: 5.5 bits a weight, in the kernel's layout too), Q5_1
(`Q51Weight`, w = d * q + m, an fp16 d and m per 32: 6 bits, as the kernel's layout), Q5_K
and Q4_K (`Q5KWeight`, `Q4KWeight`: w = d * sc * q - dmin * m, per 256 columns an fp16 d and dmin, per 32 a 6-bit sc
and m: 5.5 and 4.5 bits, 5.75 and 4.75 in the kernel's layout). As int8 per row a weight reads 8 bits and its values
are rounded again; as int4's groups Q4_K read 5 bits, its scales rounded to bf16. Q4_K_M files are mostly Q4_K and
keep a tensor at Q5_0 where its rows are not a multiple of 256 (DeepSeek-V2's experts' down projections: 1408
columns); Q5_K_M files are mostly Q5_K and keep those at Q5_1."""
from __future__ import annotations

from latentserve.kernels import native
from latentserve.layers.quant.file_blocks import NativeFileBlocksLinear
from latentserve.layers.quant.prequantized import KQUANT_COLUMNS


class NativeQ50Linear(NativeFileBlocksLinear):
    """latentserve's Q5_0 kernel (`native.pack_q50`'s layout) at every row count."""

    kernel, weight_kind, group = "latentserve q5_0", native.Q50, 32
    expert_format = native.Q50_FORMAT
    file_type, columns, read = "Q5_0", 64, "5.5 bits a weight read; int8 per row reads 8 and rounds the values again"
    pack, linear = staticmethod(native.pack_q50), staticmethod(native.q50_linear)


class NativeQ51Linear(NativeFileBlocksLinear):
    """latentserve's Q5_1 kernel (`native.pack_q51`'s layout) at every row count."""

    kernel, weight_kind, group = "latentserve q5_1", native.Q51, 32
    expert_format = native.Q51_FORMAT
    file_type, columns, read = "Q5_1", 64, "6 bits a weight read; int8 per row reads 8 and rounds the values again"
    pack, linear = staticmethod(native.pack_q51), staticmethod(native.q51_linear)


class NativeQ5KLinear(NativeFileBlocksLinear):
    """latentserve's Q5_K kernel (`native.pack_q5k`'s layout) at every row count."""

    kernel, weight_kind, group = "latentserve q5_k", native.Q5K, 256
    expert_format = native.Q5K_FORMAT
    file_type, columns = "Q5_K", KQUANT_COLUMNS
    read = "5.75 bits a weight read; int8 per row reads 8 and rounds the values again"
    pack, linear = staticmethod(native.pack_q5k), staticmethod(native.q5k_linear)


class NativeQ4KLinear(NativeFileBlocksLinear):
    """latentserve's Q4_K kernel (`native.pack_q4k`'s layout) at every row count."""

    kernel, weight_kind, group = "latentserve q4_k", native.Q4K, 256
    expert_format = native.Q4K_FORMAT
    file_type, columns = "Q4_K", KQUANT_COLUMNS
    read = "4.75 bits a weight read, d * sc exactly; int4's groups read 5 and round it to bf16"
    pack, linear = staticmethod(native.pack_q4k), staticmethod(native.q4k_linear)
