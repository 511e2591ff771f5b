"""RMSNorm, computed in fp32 as DeepSeek's reference does."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from latentserve.kernels import native
from latentserve.kernels.policy import KernelPolicy, default_policy


class RMSNorm(nn.Module):
    """Through latentserve's kernel where the policy has one, asked once by `process_weights_after_loading` (a norm
    built outside a loader asks `default_policy()` at its first call)."""

    kernels: native.NativeKernels | None = None
    asked = False

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def process_weights_after_loading(self, policy: KernelPolicy) -> None:
        self.kernels, self.asked = policy.kernels, True

    def _kernels_for(self, dtype: torch.dtype) -> native.NativeKernels | None:
        """The kernels whose rms_norm this norm runs on CPU `dtype` inputs, or None (torch's norm)."""
        if not self.asked:
            self.process_weights_after_loading(default_policy())
        return self.kernels if dtype == self.weight.dtype in native.KERNEL_DTYPES else None

    def native_norm(self, kernels: native.NativeKernels, dtype: torch.dtype) -> tuple[torch.Tensor, float] | None:
        """(weight, eps) where this norm runs `kernels`' rms_norm on CPU `dtype` inputs, as a native call that ends in
        it (`native.decode_layers`) may apply it; else None."""
        mine = self._kernels_for(dtype)
        return (self.weight, self.eps) if mine is not None and mine == kernels else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = self._kernels_for(x.dtype)
        if kernels is not None and x.device.type == "cpu":
            # one call, where torch's composite norm runs half a dozen small ops
            return native.rms_norm(kernels, x, self.weight, self.eps)
        shape = (x.shape[-1],)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, shape, self.weight, self.eps)  # one call: the same math, op for op
        # The reference casts back before the weight multiply; keep that rounding order.
        return self.weight * F.rms_norm(x.float(), shape, eps=self.eps).to(x.dtype)
