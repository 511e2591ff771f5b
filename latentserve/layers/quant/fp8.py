"""DeepSeek's block-wise FP8 weights, dequantized as published: w = w_fp8 * scale_inv of its block."""
from __future__ import annotations

import torch


def dequantize_block_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], name: str = "weight"
) -> torch.Tensor:
    """fp32 `[out, in]` from float8_e4m3fn `weight` `[out, in]` and float32 `scale_inv` `[ceil(out/bo), ceil(in/bi)]`;
    the last block of a row or column may be partial."""
    if weight.dim() != 2:
        raise ValueError(f"{name}: FP8 weights must be 2-D, got shape {tuple(weight.shape)}")
    (rows, cols), (bo, bi) = weight.shape, block
    expected = (-(-rows // bo), -(-cols // bi))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"{name}_scale_inv has shape {tuple(scale_inv.shape)}; weight {(rows, cols)} in blocks of {block} "
            f"needs {expected}"
        )
    scale = scale_inv.float().repeat_interleave(bo, 0)[:rows].repeat_interleave(bi, 1)[:, :cols]
    return weight.to(torch.float32).mul_(scale)  # a new fp32 tensor: the fp8 one is left as it was
