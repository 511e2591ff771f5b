"""Choose the decode backend for a device and dtype."""
from __future__ import annotations

import torch

from latentserve.attention.backend import SelectorConfig, select_backend
from latentserve.attention.decode.registry import MLADecodeBackendEnum

PRIORITY = (MLADecodeBackendEnum.NATIVE, MLADecodeBackendEnum.PAGED, MLADecodeBackendEnum.TORCH, MLADecodeBackendEnum.REFERENCE)


def get_mla_decode_backend(
    device: torch.device | str,
    selector_config: SelectorConfig,
    selected: MLADecodeBackendEnum | str | None = None,
) -> type:
    """The backend class: `selected` if it is valid (else every reason), otherwise the first valid by priority."""
    return select_backend(MLADecodeBackendEnum, PRIORITY, device, selector_config, selected)
