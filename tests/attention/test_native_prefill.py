"""NATIVE prefill attention (kernels/prefill_attention.c) against REFERENCE's fp32 softmax, for each build of the
kernels this machine runs: causal and not, queries after their keys, sliding windows, queries that see no key,
shapes off every block size, strided views, fp32 and bf16; and its boundary's refusals."""
import dataclasses

import pytest
import torch

from latentserve.attention.prefill import selector
from latentserve.attention.prefill.native import NativePrefillBackend
from latentserve.attention.prefill.reference import ReferencePrefillBackend
from latentserve.attention.prefill.selector import get_mla_prefill_backend
from latentserve.attention.backend import SelectorConfig
from latentserve.kernels import native
from latentserve.kernels.policy import default_policy
from tests.kernels.builds import ISAS, kernels, needs_a_build, needs_the_engines_kernels

pytestmark = needs_a_build

# (queries, keys, heads, D, V, causal, distance, window): past QT (32) queries and KB (16-64) keys, odd D (a bf16
# pair's half), V over D (GLM-4.7-Flash), a window inside and beyond the keys, queries after a context chunk.
CASES = [(37, 37, 3, 24, 16, True, 0, None), (100, 70, 2, 33, 20, False, 5, None),
         (130, 130, 4, 192, 128, True, 0, None), (50, 200, 2, 64, 64, True, 150, 40),
         (65, 65, 2, 20, 40, True, 0, 7), (5, 9, 1, 8, 8, False, 0, 3), (1, 1, 1, 1, 1, True, 0, None)]


def _pair(dims, window=None):
    n, m, heads, D, V = dims[:5]
    shape = dict(kv_lora_rank=32, qk_nope_head_dim=D - 1, qk_rope_head_dim=1, v_head_dim=V, sliding_window=window)
    return NativePrefillBackend(heads, D ** -0.5, **shape), ReferencePrefillBackend(heads, D ** -0.5, **shape)


def _inputs(n, m, heads, D, V, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, heads, D, generator=gen).to(dtype), torch.randn(m, heads, D, generator=gen).to(dtype),
            torch.randn(m, heads, V, generator=gen).to(dtype))


@needs_the_engines_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("case", CASES)
def test_native_prefill_matches_reference(isa, dtype, tol, case):
    n, m, heads, D, V, causal, distance, window = case
    ours, ref = _pair(case, window)
    ours.kernels = kernels(isa)
    q, k, v = _inputs(n, m, heads, D, V, dtype)
    out, lse = ours._attend(q, k, v, causal, distance)
    want, want_lse = ref._attend(q, k, v, causal, distance)
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol)
    seen = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), seen)  # a query that sees no key: lse -inf, output 0
    assert not out[~seen.any(1)].any()
    torch.testing.assert_close(lse[seen], want_lse[seen], rtol=tol, atol=tol)


@needs_the_engines_kernels
@pytest.mark.parametrize("isa", ISAS)
def test_queries_before_every_key_get_zero_and_minus_infinity(isa):
    """A context chunk wholly behind a windowed query's reach, and a causal query before key 0."""
    q, k, v = _inputs(6, 10, 2, 16, 8, torch.float32)
    windowed = NativePrefillBackend(2, 0.25, 32, 15, 1, 8, sliding_window=3)
    windowed.kernels = kernels(isa)
    out, lse = windowed._attend(q, k, v, causal=False, distance=100)
    assert not out.any() and (lse == float("-inf")).all()
    causal = NativePrefillBackend(2, 0.25, 32, 15, 1, 8)
    causal.kernels = kernels(isa)
    out, lse = causal._attend(q, k, v, causal=True, distance=-3)  # queries 0..2 precede key 0
    assert not out[:3].any() and (lse[:3] == float("-inf")).all() and torch.isfinite(lse[3:]).all()


@needs_the_engines_kernels
def test_views_are_read_in_place_and_other_layouts_copied():
    """v as MLA makes it (the value columns of kv_b's rows, a view); q head-major (a transpose): same result."""
    q, k, _ = _inputs(40, 40, 3, 24, 16, torch.float32, seed=1)
    rows = torch.randn(40, 3, 40)
    v = rows[..., 24:]
    rows[..., :24] = float("nan")  # what lies beside v's columns is never read
    ours, ref = _pair((40, 40, 3, 24, 16))
    want = ref._attend(q, k, v, True, 0)[0]
    torch.testing.assert_close(ours._attend(q, k, v, True, 0)[0], want, rtol=2e-6, atol=2e-6)
    head_major = q.transpose(0, 1).contiguous().transpose(0, 1)
    torch.testing.assert_close(ours._attend(head_major, k, v, True, 0)[0], want, rtol=2e-6, atol=2e-6)


@needs_the_engines_kernels
def test_half_precision_runs_in_fp32():
    q, k, v = _inputs(20, 20, 2, 16, 8, torch.float16)
    ours, ref = _pair((20, 20, 2, 16, 8))
    out = ours._attend(q, k, v, True, 0)[0]
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, ref._attend(q, k, v, True, 0)[0], rtol=2e-3, atol=2e-3)


@needs_the_engines_kernels
@pytest.mark.parametrize("bad,match", [
    (lambda q, k, v: (q, k.bfloat16(), v), r"k must be a CPU tensor, float32"),
    (lambda q, k, v: (q, k[:, :1], v), r"k must be a CPU tensor, float32 \[\*, 2, 8\]"),
    (lambda q, k, v: (q, k, v[:3]), r"v must be a CPU tensor, float32 \[5, 2, \*\]"),
    (lambda q, k, v: (q.double(), k, v), r"q must be a CPU tensor, float32 or bfloat16"),
    (lambda q, k, v: (q, k, v.to("meta")), r"v must be a CPU tensor"),
])
def test_wrapper_refuses_what_the_kernel_cannot_read(bad, match):
    q, k, v = _inputs(4, 5, 2, 8, 6, torch.float32)
    with pytest.raises(ValueError, match=match):
        native.prefill_attention(kernels(ISAS[-1]), *bad(q, k, v), True, 0, None, 0.3)
    with pytest.raises(ValueError, match="window must be a positive"):
        native.prefill_attention(kernels(ISAS[-1]), q, k, v, True, 0, 0, 0.3)
    with pytest.raises(ValueError, match="distance must be within"):
        native.prefill_attention(kernels(ISAS[-1]), q, k, v, True, 1 << 63, None, 0.3)


@needs_the_engines_kernels
def test_kernel_refuses_mismatched_descriptors_itself():
    """Past the wrapper (a caller of the library alone): sizes that do not fit each other are refused by name."""
    lib = kernels(ISAS[-1])
    q, k, v = _inputs(4, 5, 2, 8, 6, torch.float32)
    out, lse = torch.empty(4, 2, 6), torch.empty(4, 2)
    desc = native.desc
    assert lib.lib.ls_prefill_attention(desc(q), desc(k), desc(v), 1, 0, 0, 0.3, desc(out), desc(lse), 1) == 0
    code = lib.lib.ls_prefill_attention(desc(q), desc(k), desc(v[:4]), 1, 0, 0, 0.3, desc(out), desc(lse), 1)
    assert code == native.abi.BAD_TENSOR and b"v: dim 0 is 4, not 5" in lib.lib.ls_last_error()
    code = lib.lib.ls_prefill_attention(desc(q), desc(k), desc(v), 1, 0, 0, 0.3, desc(out[:, :, :5]), desc(lse), 1)
    assert code == native.abi.BAD_TENSOR
    code = lib.lib.ls_prefill_attention(desc(q), desc(k), desc(v), 1, 0, -1, 0.3, desc(out), desc(lse), 1)
    assert code == native.abi.BAD_TENSOR and b"window" in lib.lib.ls_last_error()
    code = lib.lib.ls_prefill_attention(desc(q), desc(k), desc(v), 1, 1 << 62, 0, 0.3, desc(out), desc(lse), 1)
    assert code == native.abi.BAD_TENSOR and b"distance" in lib.lib.ls_last_error()
    code = lib.lib.ls_prefill_attention(desc(q.transpose(0, 1)), desc(k), desc(v), 1, 0, 0, 0.3, desc(out),
                                        desc(lse), 1)
    assert code == native.abi.BAD_TENSOR


def test_selected_first_on_the_cpu_where_the_kernels_run():
    """NATIVE first where the kernels run, but in bf16 on AMX tiles (the policy's native_prefill), where PyTorch's
    flash kernel goes first; a shape that one cannot take (v wider than q) falls to NATIVE there."""
    available = NativePrefillBackend.unavailable_reason() is None
    fp32, bf16 = (SelectorConfig(dtype, 16, 512, 128, 64, 128) for dtype in (torch.float32, torch.bfloat16))
    assert get_mla_prefill_backend("cpu", fp32).get_name() == ("NATIVE" if available else "TORCH_SDPA")
    native_bf16 = available and default_policy().native_prefill(torch.bfloat16)
    assert get_mla_prefill_backend("cpu", bf16).get_name() == ("NATIVE" if native_bf16 else "TORCH_SDPA")
    wide = SelectorConfig(torch.bfloat16, 16, 512, 128, 64, 256)  # v wider than q: TORCH_SDPA cannot, NATIVE can
    assert get_mla_prefill_backend("cpu", wide).get_name() == ("NATIVE" if available else "REFERENCE")


@needs_the_engines_kernels
def test_on_amx_tiles_bf16_goes_to_torchs_flash_kernel_first(monkeypatch):
    """What an AMX CPU's policy makes of the order, wherever this runs: bf16 to TORCH_SDPA, fp32 to NATIVE."""
    here = default_policy()
    xeon = dataclasses.replace(here, features=dataclasses.replace(here.features, amx=True, onednn_bf16=True))
    monkeypatch.setattr(selector, "default_policy", lambda: xeon)
    for dtype, expected in ((torch.bfloat16, "TORCH_SDPA"), (torch.float32, "NATIVE")):
        assert get_mla_prefill_backend("cpu", SelectorConfig(dtype, 16, 512, 128, 64, 128)).get_name() == expected
