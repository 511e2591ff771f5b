"""dtype="auto": bf16 only where the CPU computes bf16 natively, fp32 elsewhere; an override and explicit dtypes win."""
from __future__ import annotations

import pytest
import torch

from latentserve.engine.engine_config import parse_dtype
from latentserve.kernels import cpu
from latentserve.kernels.cpu import AUTO_DTYPE_ENV, auto_dtype, cpu_features


def _pretend(monkeypatch, capability: str, avx512_bf16: bool, amx: bool = False) -> None:
    monkeypatch.delenv(AUTO_DTYPE_ENV, raising=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    # oneDNN's bf16 follows the CPU too (and ONEDNN_MAX_CPU_ISA, when a developer caps it)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: avx512_bf16 or amx)


@pytest.mark.parametrize("capability, avx512_bf16, amx, expected", [
    ("AVX512", True, False, torch.bfloat16),
    ("AVX512", False, True, torch.bfloat16),  # AMX tiles do bf16 too
    ("AVX512", False, False, torch.float32),  # AVX-512 without bf16 instructions emulates it
    ("AVX2", True, False, torch.float32),  # ATEN_CPU_CAPABILITY=avx2: torch dispatches AVX2 kernels
    ("DEFAULT", False, False, torch.float32),
])
def test_auto_is_bf16_only_with_native_bf16(monkeypatch, capability, avx512_bf16, amx, expected):
    _pretend(monkeypatch, capability, avx512_bf16, amx)
    dtype, why = auto_dtype("cpu")
    assert dtype == expected and parse_dtype("auto") == expected
    assert capability in why
    assert cpu_features().native_bf16 == (expected == torch.bfloat16)


def test_override_and_explicit_dtypes_win(monkeypatch):
    _pretend(monkeypatch, "AVX512", True)
    assert parse_dtype("float32") == torch.float32 and parse_dtype(torch.float16) == torch.float16
    monkeypatch.setenv(AUTO_DTYPE_ENV, "fp32")
    assert auto_dtype("cpu") == (torch.float32, f"set by {AUTO_DTYPE_ENV}=fp32")
    monkeypatch.setenv(AUTO_DTYPE_ENV, "int3")
    with pytest.raises(ValueError, match=f"{AUTO_DTYPE_ENV}='int3' is not a dtype"):
        parse_dtype("auto")
    monkeypatch.delenv(AUTO_DTYPE_ENV)
    assert parse_dtype("auto", "cuda") == torch.bfloat16


def test_this_machine_is_read_from_torch():
    features = cpu_features()
    assert features.capability == torch.backends.cpu.get_cpu_capability()
    assert features.avx512_bf16 == torch.cpu._is_avx512_bf16_supported()
    assert cpu.cpu_features().describe().startswith(f"capability {features.capability}")
