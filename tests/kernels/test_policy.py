"""`KernelPolicy`: one frozen object from the CPU, `LATENTSERVE_NATIVE_KERNELS` and the thread count, the same one
`latentserve backends` prints."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from latentserve.kernels import native
from latentserve.kernels.cpu import cpu_features
from latentserve.kernels.policy import HEAD_TOKENS, KernelPolicy, default_policy


def test_detect_follows_the_setting_and_the_threads(monkeypatch):
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    off = KernelPolicy.detect(3)
    assert off == KernelPolicy(cpu_features(), None, f"{native.NATIVE_ENV}=0", 3)
    assert off.dense_rows(torch.float32, 64) == off.head_tokens == 0
    assert default_policy().kernels is None and default_policy() is default_policy()  # looked up once
    monkeypatch.setenv(native.NATIVE_ENV, "1")
    on = KernelPolicy.detect()
    assert on.threads == torch.get_num_threads() and on.features == cpu_features()
    assert on.kernels == native.native_kernels(cpu_features())[0]
    if on.kernels is not None:
        assert (on.head_tokens, on.dense_rows(torch.float32, 4096)) == (HEAD_TOKENS, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        on.threads = 4


def test_native_prefill_gives_bf16_to_torch_on_amx_tiles():
    zen4 = dataclasses.replace(cpu_features(), capability="AVX512", avx512_bf16=True, amx=False, onednn_bf16=True)
    xeon = dataclasses.replace(zen4, amx=True)
    on_zen4 = KernelPolicy(zen4, native.NativeKernels("avx512_bf16", None), "AVX-512", 2)
    on_xeon = KernelPolicy(xeon, native.NativeKernels("avx512_amx", None), "AMX", 2)
    assert on_zen4.native_prefill(torch.bfloat16) and on_zen4.native_prefill(torch.float32)
    assert not on_xeon.native_prefill(torch.bfloat16) and on_xeon.native_prefill(torch.float32)
    assert "prefill attention in bf16: PyTorch's flash kernel first" in on_xeon.describe()
    assert "prefill attention" not in on_zen4.describe()
    assert not KernelPolicy(xeon, None, "off", 2).native_prefill(torch.float32)


def test_describe_names_the_build_or_why_there_is_none():
    features = cpu_features()
    none = KernelPolicy(features, None, "no vector build", 2).describe().splitlines()
    assert none == [f"features: {features.describe()}", "latentserve's kernels: not used (no vector build)",
                    "threads: 2"]
    built = KernelPolicy(features, native.NativeKernels("avx2", None), "AVX2", 1).describe()
    assert "latentserve's kernels: built for avx2 (AVX2)" in built
    assert "up to 3 fp32 rows and 1 bf16 rows (4 over inputs of <= 512)" in built  # no vdpbf16ps, one thread
    assert f"up to {HEAD_TOKENS} tokens" in built
