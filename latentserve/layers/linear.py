"""`Linear`: nn.Linear whose skinny CPU products are laid out so that MKL keeps every thread streaming weights."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Rows for which (W @ xᵀ)ᵀ beats x @ Wᵀ on CPU with several threads (benchmarks/vs_transformers.py, "Linear
# layouts"): with a few rows x @ Wᵀ keeps MKL's threads idle, W @ xᵀ splits the weight's rows over them.
SKINNY_ROWS = range(2, 33)


def _split_gemv(x: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """x `[1, in]` @ Wᵀ as one bmm over `parts` row blocks of W: each thread streams its own block.

    MKL runs a lone matrix-vector product on one thread at ~half the memory bandwidth; the blocks are views,
    so nothing is copied."""
    blocks = weight.unflatten(0, (parts, -1)).transpose(1, 2)  # [parts, in, out/parts]
    return torch.bmm(x.expand(parts, 1, x.shape[1]), blocks).view(1, weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x `[T, in]`; contiguous `[T, out]`."""
    threads = torch.get_num_threads()
    if x.device.type != "cpu" or x.dim() != 2 or threads == 1:
        return F.linear(x, weight, bias)
    if x.shape[0] == 1 and weight.shape[0] % threads == 0:
        out = _split_gemv(x, weight, threads)
    elif x.shape[0] in SKINNY_ROWS:
        out = torch.mm(weight, x.t()).t().contiguous()
    else:
        return F.linear(x, weight, bias)
    return out if bias is None else out.add_(bias)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
