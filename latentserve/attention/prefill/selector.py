"""Choose the prefill backend for a device and dtype."""
from __future__ import annotations

import torch

from latentserve.attention.backend import SelectorConfig, select_backend
from latentserve.attention.prefill.registry import MLAPrefillBackendEnum
from latentserve.kernels.policy import default_policy


def priority(dtype: torch.dtype) -> tuple[MLAPrefillBackendEnum, ...]:
    """NATIVE first where the kernel policy puts latentserve's prefill attention first for `dtype` (the CPU, but bf16
    on AMX tiles), PyTorch's flash kernel first elsewhere (CUDA, where NATIVE is not valid), the oracle last."""
    native, sdpa = MLAPrefillBackendEnum.NATIVE, MLAPrefillBackendEnum.TORCH_SDPA
    first = (native, sdpa) if default_policy().native_prefill(dtype) else (sdpa, native)
    return (*first, MLAPrefillBackendEnum.REFERENCE)


def get_mla_prefill_backend(
    device: torch.device | str,
    selector_config: SelectorConfig,
    selected: MLAPrefillBackendEnum | str | None = None,
) -> type:
    """The backend class: `selected` if it is valid (else every reason), otherwise the first valid by priority."""
    return select_backend(MLAPrefillBackendEnum, priority(selector_config.dtype), device, selector_config, selected)
