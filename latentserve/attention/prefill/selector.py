"""Choose the prefill backend for a device and dtype."""
from __future__ import annotations

import torch

from latentserve.attention.backend import SelectorConfig, select_backend
from latentserve.attention.prefill.registry import MLAPrefillBackendEnum

# NATIVE where latentserve's kernels run (the CPU), PyTorch's flash kernel elsewhere (CUDA), the oracle last.
PRIORITY = (MLAPrefillBackendEnum.NATIVE, MLAPrefillBackendEnum.TORCH_SDPA, MLAPrefillBackendEnum.REFERENCE)


def get_mla_prefill_backend(
    device: torch.device | str,
    selector_config: SelectorConfig,
    selected: MLAPrefillBackendEnum | str | None = None,
) -> type:
    """The backend class: `selected` if it is valid (else every reason), otherwise the first valid by priority."""
    return select_backend(MLAPrefillBackendEnum, PRIORITY, device, selector_config, selected)
