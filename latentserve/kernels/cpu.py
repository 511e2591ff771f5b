"""What this CPU computes fast: decides `dtype="auto"` and the quantized linear kernels."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from latentserve.config import DTYPES

# Overrides what dtype="auto" resolves to (any dtype name LLM accepts), e.g. to compare formats on one machine.
AUTO_DTYPE_ENV = "LATENTSERVE_AUTO_DTYPE"


@dataclass(frozen=True)
class CpuFeatures:
    capability: str  # torch.backends.cpu.get_cpu_capability(): "DEFAULT", "AVX2", "AVX512", ...
    avx512_bf16: bool
    amx: bool
    vnni: bool  # int8 dot products (AVX512-VNNI or AVX-VNNI)
    onednn_bf16: bool
    avx_vnni: bool = False  # AVX-VNNI itself (vpdpbusd on 256 bits, VEX-encoded): the avx2_vnni kernels' build

    @property
    def native_bf16(self) -> bool:
        """bf16 matmuls run in hardware; elsewhere they are emulated and slower than fp32 (AVX2: 3-7x)."""
        return self.capability.startswith("AVX512") and (self.avx512_bf16 or self.amx) and self.onednn_bf16

    def describe(self) -> str:
        flags = [name for name in ("avx512_bf16", "amx", "vnni", "avx_vnni", "onednn_bf16")
                 if getattr(self, name)]
        return f"capability {self.capability}; " + (", ".join(flags) if flags else "no bf16/int8 extensions")


def cpu_features() -> CpuFeatures:
    """The running CPU as torch dispatches on it (`ATEN_CPU_CAPABILITY=avx2` makes an AVX-512 machine an AVX2 one)."""
    return CpuFeatures(
        capability=torch.backends.cpu.get_cpu_capability(),
        avx512_bf16=torch.cpu._is_avx512_bf16_supported(),
        amx=torch.cpu._is_amx_tile_supported(),
        vnni=torch.cpu._is_vnni_supported(),
        onednn_bf16=torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported(),
        avx_vnni="avx_vnni" in cpu_flags(),
    )


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them in /proc/cpuinfo (the first CPU's); empty where it does not (torch
    names no AVX-VNNI apart from AVX512-VNNI)."""
    return frozenset(_cpuinfo("flags").split())


@functools.cache
def cpu_vendor() -> str:
    """The CPU's maker as its CPUID names it ("GenuineIntel", "AuthenticAMD"), from /proc/cpuinfo; "" where Linux
    does not say."""
    return _cpuinfo("vendor_id").strip()


def _cpuinfo(field: str) -> str:
    """The first CPU's `field` in /proc/cpuinfo; "" where there is none."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                name, _, value = line.partition(":")
                if name.strip() == field:
                    return value
    except OSError:
        pass
    return ""


def last_level_cache_bytes() -> int | None:
    """The size of CPU 0's largest cache as Linux reports it, or None where it does not."""
    units, sizes = {"K": 2**10, "M": 2**20, "G": 2**30}, {}
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level, size = (index / "level").read_text().strip(), (index / "size").read_text().strip()
        except OSError:
            continue
        if level.isdigit() and size[:-1].isdigit() and size[-1] in units:
            sizes[int(level)] = int(size[:-1]) * units[size[-1]]
    return sizes[max(sizes)] if sizes else None


def auto_dtype(device: str | torch.device) -> tuple[torch.dtype, str]:
    """(dtype, why) for dtype="auto" on `device`."""
    override = os.environ.get(AUTO_DTYPE_ENV)
    if override:
        if override not in DTYPES:
            raise ValueError(f"{AUTO_DTYPE_ENV}={override!r} is not a dtype; use one of: {', '.join(DTYPES)}")
        return DTYPES[override], f"set by {AUTO_DTYPE_ENV}={override}"
    if torch.device(device).type == "cuda":
        return torch.bfloat16, "CUDA"
    features = cpu_features()
    if features.native_bf16:
        return torch.bfloat16, f"native bf16 on {features.capability}"
    return torch.float32, f"no native bf16 on {features.capability}: emulated bf16 is slower than fp32"
