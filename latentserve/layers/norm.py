"""RMSNorm, computed in fp32 as DeepSeek's reference does."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from latentserve.kernels import native


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (x.shape[-1],)
        if x.device.type == "cpu" and x.dtype == self.weight.dtype in native.KERNEL_DTYPES:
            kernels = native.for_this_cpu()
            if kernels is not None:  # one call, where torch's composite norm runs half a dozen small ops
                return native.rms_norm(kernels, x, self.weight, self.eps)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, shape, self.weight, self.eps)  # one call: the same math, op for op
        # The reference casts back before the weight multiply; keep that rounding order.
        return self.weight * F.rms_norm(x.float(), shape, eps=self.eps).to(x.dtype)
