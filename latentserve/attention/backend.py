"""What every attention backend class declares about itself, and picking one by priority."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from latentserve.attention.backend_registry import BackendEnum
from latentserve.kernels.policy import default_policy


@dataclass(frozen=True)
class SelectorConfig:
    """What a backend is chosen for."""

    dtype: torch.dtype
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    sliding_window: int | None = None  # each query attends its last `sliding_window` positions only


class BackendCapabilities:
    """Class-level facts a selector asks a backend before constructing it."""

    # The KV cache's dtype: fp8 (e4m3) and int8 caches are dequantized as they are read.
    supported_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
                                                 torch.int8)
    supported_device_types: tuple[str, ...] = ("cpu", "cuda")
    supports_sliding_window: bool = False

    @classmethod
    def get_name(cls) -> str:
        raise NotImplementedError

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        return dtype in cls.supported_dtypes

    @classmethod
    def supports_device(cls, device: torch.device | str) -> bool:
        return torch.device(device).type in cls.supported_device_types

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this installation cannot run the backend at all; None where it can."""
        return None

    @classmethod
    def validate_configuration(cls, device: torch.device | str, selector_config: SelectorConfig) -> list[str]:
        """Every reason this backend cannot serve the configuration; empty when it can."""
        reasons = []
        if (why := cls.unavailable_reason()) is not None:
            reasons.append(f"{cls.get_name()} is not available here: {why}")
        if not cls.supports_device(device):
            reasons.append(f"{cls.get_name()} does not support device {torch.device(device).type!r}")
        if not cls.supports_dtype(selector_config.dtype):
            reasons.append(f"{cls.get_name()} does not support dtype {selector_config.dtype}")
        if selector_config.sliding_window is not None and not cls.supports_sliding_window:
            reasons.append(f"{cls.get_name()} does not support sliding-window attention")
        return reasons


class NativeKernelsBackend(BackendCapabilities):
    """A backend that runs latentserve's own CPU kernels (the prefill and the decode `NATIVE`): the CPU only, where
    the kernels build and the policy uses them."""

    supported_device_types = ("cpu",)

    @classmethod
    def get_name(cls) -> str:
        return "NATIVE"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return default_policy().unavailable


def select_backend(
    enum_cls: type[BackendEnum],
    priorities: Sequence[BackendEnum],
    device: torch.device | str,
    selector_config: SelectorConfig,
    selected: BackendEnum | str | None = None,
) -> type:
    """The explicitly `selected` backend if valid, else the first valid one in `priorities`."""
    kind = enum_cls.__name__
    if selected is not None:
        member = enum_cls.lookup(selected) if isinstance(selected, str) else selected
        cls = member.get_class()
        reasons = cls.validate_configuration(device, selector_config)
        if reasons:
            raise ValueError(f"{kind} {member.name} cannot be used: " + "; ".join(reasons))
        return cls
    rejected = []
    for member in priorities:
        cls = member.get_class()
        reasons = cls.validate_configuration(device, selector_config)
        if not reasons:
            return cls
        rejected.append(f"{member.name}: " + "; ".join(reasons))
    raise ValueError(f"no valid {kind} for device {device} and {selector_config}: " + " | ".join(rejected))
