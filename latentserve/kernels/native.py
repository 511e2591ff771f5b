"""latentserve's own CPU kernels (qgemm.c: quantized linears; gemv.c: fp32/bf16 linears for few rows; mla_decode.c:
decode attention over the paged cache; norm.c: RMSNorm; prologue.c: MLA's latent norm, RoPE and cache write;
attention_block.c: a decode step's whole MLA attention block; route.c: MoE routing; moe_block.c: a decode step's
whole MoE block):
built with the system C compiler on first use, per instruction set, cached, and loaded through ctypes. Where they
cannot be built the callers keep PyTorch's kernels."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from latentserve.kernels.cpu import CpuFeatures

KERNEL_DIR = Path(__file__).parent
SOURCES = tuple(KERNEL_DIR / name for name in ("quant_acts.c", "qgemm.c", "int4.c", "gemv.c", "mla_decode.c", "norm.c",
                                               "prologue.c", "attention_block.c", "route.c", "moe_block.c"))
HEADERS = (KERNEL_DIR / "simd.h", KERNEL_DIR / "quant.h")
# "0" keeps PyTorch's kernels (fbgemm, int4pack_mm) even where these build, e.g. to compare them; "1" (default) not.
NATIVE_ENV = "LATENTSERVE_NATIVE_KERNELS"
CACHE_ENV = "LATENTSERVE_CACHE_DIR"
ISA_FLAGS = {
    "avx512_vnni": ["-DLS_AVX512", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512vnni"],
    "avx2": ["-mavx2", "-mfma"],
}
# The same with AVX512-BF16: bf16 products (decode attention, few-row linears, experts' gate and up) through
# vdpbf16ps.
ISA_FLAGS["avx512_bf16"] = ISA_FLAGS["avx512_vnni"] + ["-mavx512bf16", "-DLS_BF16DOT"]
FALLBACK = {"avx512_bf16": "avx512_vnni"}  # where a compiler cannot build the first, the second still runs
# No fused multiply-adds but the kernels' explicit ones: prologue.c's rotation rounds as torch's elementwise ops do.
CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-shared", "-fPIC"]


@dataclass(frozen=True)
class NativeKernels:
    isa: str
    lib: ctypes.CDLL

    @property
    def bf16_dot(self) -> bool:
        """Whether bf16 products multiply through vdpbf16ps (the avx512_bf16 build)."""
        return self.isa == "avx512_bf16"


def kernel_isa(features: CpuFeatures) -> tuple[str | None, str]:
    """(instruction set to build for, why) from what torch dispatches on: `ATEN_CPU_CAPABILITY=avx2` picks the AVX2
    build on an AVX-512 machine, as it does torch's own kernels."""
    setting = os.environ.get(NATIVE_ENV, "1")
    if setting not in ("0", "1"):
        raise ValueError(f"{NATIVE_ENV}={setting!r}: use 1 (latentserve's kernels where they build) or 0 (PyTorch's)")
    if setting == "0":
        return None, f"{NATIVE_ENV}=0"
    if features.capability.startswith("AVX512") and features.vnni:
        if features.avx512_bf16:
            return "avx512_bf16", "AVX-512 with VNNI and BF16"
        return "avx512_vnni", "AVX-512 with VNNI"
    if features.capability.startswith(("AVX512", "AVX2")):
        return "avx2", f"{features.capability} without VNNI" if features.capability != "AVX2" else "AVX2"
    return None, f"capability {features.capability}: no vector build"


def _cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "latentserve")
    return Path(root).expanduser() / "kernels"


def _build(isa: str) -> Path:
    """The shared library for `isa`, compiled unless a build of this source with these flags is cached."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    flags = CFLAGS + ISA_FLAGS[isa]
    text = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    key = hashlib.sha256(text + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"qgemm-{isa}-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place: processes that build at once never load a partial file.
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".so.partial")
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", partial], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-400:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.ls_int8_heads.argtypes = lib.ls_int8_heads_lanes.argtypes = [p, i64, i64, i64, p, p, p, i64, p, i32, i32]
    lib.ls_int4_linear.argtypes = [p, i64, i64, p, i64, i64, p, i32, i32]
    lib.ls_experts_tokens.argtypes = [p, i64, i64, i64, i64, p, p, i32, i64, i64, p, i32, i32]
    lib.ls_experts_tokens.restype = None
    lib.ls_mla_decode.argtypes = [p, i64, i64, i64, i64, p, i64, p, i64, p, p, i64, ctypes.c_float, p, i32, i32]
    lib.ls_mla_decode.restype = None
    lib.ls_dense_linear.argtypes = [p, i64, i64, p, i64, p, i32, i32]
    lib.ls_dense_linear.restype = None
    lib.ls_dense_heads.argtypes = [p, i64, i64, i64, p, i64, p, i32, i32]
    lib.ls_dense_heads.restype = None
    lib.ls_stacked_experts.argtypes = [p, i64, i64, i64, i64, p, p, i64, i64, p, p, i64, p, p, p, p, i32, i32]
    lib.ls_stacked_experts.restype = i32
    lib.ls_rms_norm.argtypes = [p, i64, i64, p, ctypes.c_float, p, i32, i32]
    lib.ls_rms_norm.restype = None
    lib.ls_mla_prologue.argtypes = [p, i64, i64, i64, p, i64, i64, p, ctypes.c_float, p, p, i32, p, p, p, p, i32, i32]
    lib.ls_mla_prologue.restype = None
    lib.ls_mla_attention_block.argtypes = [p, p, i64, p, p, p, i32, i64, p, i64, p, p, i64, p, p, p, i32]
    lib.ls_mla_attention_block.restype = None
    lib.ls_route.argtypes = [p, i64, i64, i64, i32, i64, i64, p, i32, ctypes.c_float, p, p]
    lib.ls_route.restype = None
    lib.ls_moe_block.argtypes = [p, p, p, i64, p, i32]
    lib.ls_moe_block.restype = i32
    for name in ("ls_int8_heads", "ls_int8_heads_lanes", "ls_int4_linear"):
        getattr(lib, name).restype = None


@functools.cache
def load(isa: str) -> NativeKernels | str:
    """The kernels for `isa`, built (or found cached) and loaded; or why they cannot be (remembered: one try)."""
    try:
        lib = ctypes.CDLL(str(_build(isa)))  # ctypes releases the GIL during calls: DBO's ubatch threads overlap
    except (OSError, RuntimeError) as e:
        return str(e)
    _declare(lib)
    return NativeKernels(isa, lib)


def native_kernels(features: CpuFeatures) -> tuple[NativeKernels | None, str]:
    """(the kernels for this CPU or None, why)."""
    isa, why = kernel_isa(features)
    if isa is None:
        return None, why
    kernels = load(isa)
    if isinstance(kernels, str) and isa in FALLBACK:
        why = f"{why}; {isa} build unavailable ({kernels})"
        isa = FALLBACK[isa]
        kernels = load(isa)
    if isinstance(kernels, str):
        return None, f"{isa} build unavailable: {kernels}"
    return kernels, why


@functools.cache
def _for(setting: str | None, capability: str) -> NativeKernels | None:
    from latentserve.kernels.cpu import cpu_features

    return native_kernels(cpu_features())[0]


def for_this_cpu() -> NativeKernels | None:
    """The kernels for this CPU as torch dispatches on it and `LATENTSERVE_NATIVE_KERNELS` says, or None; looked up
    once per setting (cheap enough to ask on every call)."""
    return _for(os.environ.get(NATIVE_ENV), torch.backends.cpu.get_cpu_capability())


KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # what the kernels read and write; other dtypes go through fp32
PROFILE_PREFIX = "latentserve::"  # the profiler range each call gets while a torch profiler runs


def _call(kernels: NativeKernels, name: str, *args):
    """kernels.lib.`name`(*args) and what it returns, inside a profiler range named after it while torch's profiler
    runs (ctypes calls are invisible to it otherwise)."""
    fn = getattr(kernels.lib, name)
    # The profiler's module-level flag: torch.autograd._profiler_enabled() stays False under an all-threads profile.
    if torch.autograd.profiler._is_profiler_enabled:
        with torch.profiler.record_function(PROFILE_PREFIX + name):
            return fn(*args)
    return fn(*args)


def activations(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """x as the kernels take it: `[rows, in_features]`, contiguous, fp32 or bf16."""
    x = x.reshape(-1, in_features)
    return (x if x.dtype in KERNEL_DTYPES else x.float()).contiguous()


def _io(x: torch.Tensor, out_dtype: torch.dtype) -> tuple[torch.dtype, int]:
    """(the output's dtype, the kernels' flags: bit 0 x is bf16, bit 1 y is)."""
    out = out_dtype if out_dtype in KERNEL_DTYPES else torch.float32
    return out, int(x.dtype == torch.bfloat16) | int(out == torch.bfloat16) << 1


def int8_linear(kernels: NativeKernels, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, qsum: torch.Tensor,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`[M, N]` = x `[M, K]` (`activations`) times the int8 weight q `[N, K]` with per-row `scale`, `qsum` =
    q.sum(1) (int32); in `out_dtype` where the kernels write it, else fp32."""
    return int8_heads(kernels, x[:, None], q[None], scale, qsum, out_dtype)[:, 0]


def int8_heads(kernels: NativeKernels, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, qsum: torch.Tensor,
               out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`[M, H, N]`: y[m, h] = x[m, h] @ w[h]^T for x `[M, H, K]` (contiguous, fp32 or bf16), the int8 weights q
    `[H, N, K]` with per-row `scale` and `qsum` (q.sum(-1), int32) `[H, N]`."""
    (m, h, k), n = x.shape, q.shape[1]
    dtype, io = _io(x, out_dtype)
    y = torch.empty(m, h, n, dtype=dtype)
    _call(kernels, "ls_int8_heads", x.data_ptr(), m, h, k, q.data_ptr(), scale.data_ptr(), qsum.data_ptr(), n,
          y.data_ptr(), io, torch.get_num_threads())
    return y


def int8_lanes(q: torch.Tensor) -> torch.Tensor:
    """int8 q `[H, N, K]` (N % 16 == 0, K % 4 == 0) in `int8_heads_lanes`' layout `[H, N / 16, K / 4, 16, 4]`."""
    h, n, k = q.shape
    if q.dtype != torch.int8 or n % 16 or k % 4:
        raise ValueError(f"int8_lanes takes int8 [H, N, K] with N % 16 == 0 and K % 4 == 0, not {q.dtype} "
                         f"{tuple(q.shape)}")
    return q.view(h, n // 16, 16, k // 4, 4).transpose(2, 3).contiguous()


def int8_heads_lanes(kernels: NativeKernels, x: torch.Tensor, lanes: torch.Tensor, scale: torch.Tensor,
                     qsum: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`int8_heads` with the weight in `int8_lanes`' layout: the same outputs, short rows read as one stream."""
    (m, h, k), n = x.shape, lanes.shape[1] * 16
    dtype, io = _io(x, out_dtype)
    y = torch.empty(m, h, n, dtype=dtype)
    _call(kernels, "ls_int8_heads_lanes", x.data_ptr(), m, h, k, lanes.data_ptr(), scale.data_ptr(), qsum.data_ptr(),
          n, y.data_ptr(), io, torch.get_num_threads())
    return y


def dense_linear(kernels: NativeKernels, x: torch.Tensor, weight: torch.Tensor,
                 out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`[M, N]` = x `[M, K]` (`activations`) @ weight`[N, K]`ᵀ for a contiguous fp32 or bf16 weight, fp32 sums; in
    `out_dtype` where the kernels write it, else fp32."""
    if weight.dtype not in KERNEL_DTYPES or not weight.is_contiguous():
        raise ValueError(f"dense_linear reads a contiguous float32 or bfloat16 weight, not {weight.dtype}")
    (m, k), n = x.shape, weight.shape[0]
    dtype, io = _io(x, out_dtype)
    y = torch.empty(m, n, dtype=dtype)
    _call(kernels, "ls_dense_linear", x.data_ptr(), m, k, weight.data_ptr(), n, y.data_ptr(),
          io | int(weight.dtype == torch.bfloat16) << 2, torch.get_num_threads())
    return y


def dense_heads(kernels: NativeKernels, x: torch.Tensor, w: torch.Tensor,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`[M, H, N]`: y[m, h] = x[m, h] @ w[h] for x `[M, H, K]` (contiguous, fp32 or bf16) and a contiguous fp32 or
    bf16 w `[H, K, N]` (bmm's layout) with N a multiple of 16; fp32 sums."""
    if w.dtype not in KERNEL_DTYPES or not w.is_contiguous() or w.shape[2] % 16:
        raise ValueError(f"dense_heads reads a contiguous float32 or bfloat16 [H, K, N] weight with N % 16 == 0, "
                         f"not {w.dtype} {tuple(w.shape)}")
    (m, h, k), n = x.shape, w.shape[2]
    dtype, io = _io(x, out_dtype)
    y = torch.empty(m, h, n, dtype=dtype)
    _call(kernels, "ls_dense_heads", x.data_ptr(), m, h, k, w.data_ptr(), n, y.data_ptr(),
          io | int(w.dtype == torch.bfloat16) << 2, torch.get_num_threads())
    return y


def stacked_experts(kernels: NativeKernels, x: torch.Tensor, w13: torch.Tensor, w2t: torch.Tensor, first: int,
                    ids: torch.Tensor, weights: torch.Tensor,
                    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """`[T, K]` in x's dtype: each token of x `[T, K]` through its routed experts ids `[T, k]` (int64, global: the
    stack holds experts first..) in expert order, summed in fp32 with weights `[T, k]` (fp32), then through the shared
    experts (gate, up, transposed down `[S, K]`, S a multiple of I) with gate 1. w13 `[E, 2I, K]` (gate rows, then up
    rows), w2t `[E, I, K]`. x and every weight contiguous, of one dtype, fp32 or bf16."""
    tensors = (x, w13, w2t, *(shared or ()))
    if x.dtype not in KERNEL_DTYPES or any(t.dtype != x.dtype or not t.is_contiguous() for t in tensors):
        raise ValueError(f"stacked_experts reads contiguous x and weights of one dtype, float32 or bfloat16; got "
                         f"{[str(t.dtype) for t in tensors]}")
    if ids.dtype != torch.int64 or weights.dtype != torch.float32 or ids.shape != weights.shape:
        raise ValueError(f"stacked_experts reads int64 ids and float32 weights of one shape, got {ids.dtype} "
                         f"{tuple(ids.shape)} and {weights.dtype} {tuple(weights.shape)}")
    (tokens, k), inter = x.shape, w2t.shape[1]
    chunks = shared[0].shape[0] // inter if shared else 0
    sg, su, sd = (t.data_ptr() for t in shared) if shared else (None, None, None)
    y = torch.empty(tokens, k, dtype=x.dtype)
    ids, weights = ids.contiguous(), weights.contiguous()  # held here: a temporary's memory goes with its last use
    bad = _call(kernels, "ls_stacked_experts", x.data_ptr(), tokens, k, inter, ids.shape[1], ids.data_ptr(),
                weights.data_ptr(), first, w13.shape[0], w13.data_ptr(), w2t.data_ptr(), chunks, sg, su, sd,
                y.data_ptr(), int(x.dtype == torch.bfloat16) * 0b111, torch.get_num_threads())
    if bad:
        raise ValueError(f"stacked_experts: the stack holds experts {first}..{first + w13.shape[0] - 1}, got ids "
                         f"{ids.tolist()}")
    return y


def rms_norm(kernels: NativeKernels, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over x's last dimension in fp32, x and `weight` both fp32 or both bf16 (bf16: the normalized x
    rounds to bf16 before the weight multiplies it); in x's dtype and shape."""
    if x.dtype not in KERNEL_DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"rms_norm reads x and weight of one dtype, float32 or bfloat16; got {x.dtype}, {weight.dtype}")
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.empty_like(rows)
    io = int(x.dtype == torch.bfloat16) * 0b101
    weight = weight.contiguous()
    _call(kernels, "ls_rms_norm", rows.data_ptr(), rows.shape[0], rows.shape[1], weight.data_ptr(), eps,
          y.data_ptr(), io, torch.get_num_threads())
    return y.view(x.shape)


ROPE_STYLES = ("gptj", "interleave", "neox")  # DeepSeek's rope layouts (layers/rotary.py), prologue.c's numbering


def mla_prologue(kernels: NativeKernels, q: torch.Tensor, kv: torch.Tensor, weight: torch.Tensor, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor, style: str, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_c `[T, L]`, k_pe `[T, R]`) in kv's dtype: RMSNorm(kv[:, :L]) * weight and RoPE(kv[:, L:]) from the kv_a
    projection kv `[T, L + R]`; q `[T, H, D]` (contiguous) gets its last R dims of each head rotated in place; each
    token's [kv_c ‖ k_pe] goes to the cache `[blocks, block_size, L + R]` at its slot (int64, -1 = padding). cos,
    sin `[T, R]` fp32 as `RotaryEmbedding.cos_sin` makes them, for rope `style`. q, kv, weight of one dtype, fp32 or
    bf16; the cache fp32 or bf16."""
    tokens, width = kv.shape
    rope = cos.shape[-1]
    for name, t in (("q", q), ("weight", weight)):
        if t.dtype != kv.dtype:
            raise ValueError(f"mla_prologue reads {name} in kv's dtype {kv.dtype}, got {t.dtype}")
    if kv.dtype not in KERNEL_DTYPES or kv_cache.dtype not in KERNEL_DTYPES:
        raise ValueError(f"mla_prologue reads float32 or bfloat16 kv and cache, got {kv.dtype}, {kv_cache.dtype}")
    if not all(t.is_contiguous() for t in (q, kv, weight, kv_cache)) or kv_cache.shape[-1] != width:
        raise ValueError(f"mla_prologue reads contiguous q, kv, weight and a cache of rows of {width}")
    if slot_mapping.dtype != torch.int64 or cos.dtype != torch.float32 or rope > 1024 or q.shape[-1] < rope:
        raise ValueError("mla_prologue reads int64 slots, fp32 cos/sin and at most 1024 rope dims")
    if style not in ROPE_STYLES:
        raise ValueError(f"mla_prologue: rope style must be one of {ROPE_STYLES}, got {style!r}")
    kv_c = torch.empty(tokens, width - rope, dtype=kv.dtype)
    k_pe = torch.empty(tokens, rope, dtype=kv.dtype)
    cos, sin, slot_mapping = cos.contiguous(), sin.contiguous(), slot_mapping.contiguous()
    io = int(kv.dtype == torch.bfloat16) * 0b101 | int(kv_cache.dtype == torch.bfloat16) << 1
    _call(kernels, "ls_mla_prologue", q.data_ptr(), tokens, q.shape[1], q.shape[2], kv.data_ptr(), width - rope, rope,
          weight.data_ptr(), eps, cos.data_ptr(), sin.data_ptr(), ROPE_STYLES.index(style),
          kv_c.data_ptr(), k_pe.data_ptr(), kv_cache.data_ptr(), slot_mapping.data_ptr(), io,
          torch.get_num_threads())
    return kv_c, k_pe


DENSE, INT8, INT4, INT8_LANES = 0, 1, 2, 3  # attention_block.c's kinds of weight


class Weight(ctypes.Structure):
    """attention_block.c's view of one projection's weight: DENSE (w in the activations' dtype, `[N, K]`, per-head
    products bmm's `[H, K, N]`), INT8 (w `[N, K]` / `[H, N, K]`, per-row fp32 scale and int32 sum), INT8_LANES (the
    same in `int8_lanes`' layout) or INT4 (w in `pack_int4`'s layout, group size)."""

    _fields_ = [("kind", ctypes.c_int32), ("w", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("qsum", ctypes.c_void_p), ("group", ctypes.c_int64)]


class MLABlock(ctypes.Structure):
    """attention_block.c's view of one layer's attention: shapes (with no q_lora, q_b is q_proj), weights, norm weight
    addresses (contiguous, the activations' dtype; post_norm is the MLP's input norm) and epsilons, the softmax
    scale, the rope style (`ROPE_STYLES` index), whether activations are bf16."""

    _fields_ = [(name, ctypes.c_int64) for name in ("hidden", "heads", "nope", "rope", "latent", "v_dim", "q_lora")] + [
        (name, Weight) for name in ("q_a", "q_b", "kv_a", "o_proj", "uk", "uv")] + [
        (name, ctypes.c_void_p) for name in ("input_norm", "q_a_norm", "kv_a_norm", "post_norm")] + [
        (name, ctypes.c_float) for name in ("eps", "q_a_eps", "kv_a_eps", "post_eps", "scale")] + [
        ("style", ctypes.c_int32), ("bf", ctypes.c_int32)]


def mla_attention_block(kernels: NativeKernels, block: MLABlock, x: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, post_norm(y)) with y = x + o_proj(MLA attention(input_norm(x))), for decode tokens x `[T, hidden]`
    (contiguous, the block's dtype), their latents written to the cache; metadata as `mla_decode` and
    `mla_prologue` read it."""
    y, normed = torch.empty_like(x), torch.empty_like(x)
    _call(kernels, "ls_mla_attention_block", ctypes.byref(block), x.data_ptr(), x.shape[0], cos.data_ptr(),
          sin.data_ptr(), kv_cache.data_ptr(), int(kv_cache.dtype == torch.bfloat16), kv_cache.shape[1],
          block_table.data_ptr(), block_table.stride(0), query_start_loc.data_ptr(), seq_lens.data_ptr(),
          seq_lens.shape[0], slot_mapping.data_ptr(), y.data_ptr(), normed.data_ptr(), torch.get_num_threads())
    return y, normed


class MoEBlock(ctypes.Structure):
    """moe_block.c's view of one layer's MoE: shapes and routing (`ls_route`'s arguments), the fp32 router weight
    `[experts, hidden]` and correction bias (or None), then the experts: stacked fp32/bf16 (bits 0: w13, w2t, the
    shared experts folded in as `shared_chunks` more) or quantized (bits 8 / 4: a table of each expert's pointers as
    `experts_tokens` takes them, with gate_up's and down's int4 group sizes, the shared MLP as one more expert of
    `shared_inter`, or None)."""

    _fields_ = [(name, ctypes.c_int64) for name in ("hidden", "experts", "topk", "groups", "topk_groups")] + [
        ("sigmoid", ctypes.c_int32), ("norm", ctypes.c_int32), ("scaling", ctypes.c_float),
        ("router", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("bits", ctypes.c_int32), ("bf", ctypes.c_int32),
        ("inter", ctypes.c_int64), ("w13", ctypes.c_void_p), ("w2t", ctypes.c_void_p),
        ("shared_chunks", ctypes.c_int64), ("sg", ctypes.c_void_p), ("su", ctypes.c_void_p), ("sd", ctypes.c_void_p),
        ("table", ctypes.c_void_p), ("shared", ctypes.c_void_p), ("int4_groups", ctypes.c_int64 * 2),
        ("shared_int4_groups", ctypes.c_int64 * 2), ("shared_inter", ctypes.c_int64)]


def moe_block(kernels: NativeKernels, block: MoEBlock, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + moe(x) for a few tokens x `[T, hidden]` and the residual stream (both contiguous, the block's
    dtype)."""
    y = torch.empty_like(residual)
    bad = _call(kernels, "ls_moe_block", ctypes.byref(block), x.data_ptr(), residual.data_ptr(), x.shape[0],
                y.data_ptr(), torch.get_num_threads())
    if bad:
        raise ValueError(f"moe_block: the routing chose an expert outside the {block.experts} the block holds")
    return y


def route(kernels: NativeKernels, logits: torch.Tensor, k: int, sigmoid: bool, groups: int, topk_groups: int,
          bias: torch.Tensor | None, norm: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights `[T, k]` fp32, expert ids `[T, k]` int64) from fp32 router logits `[T, E]`: softmax or sigmoid scores
    (+ bias `[E]` to choose, not to weigh), the best `topk_groups` of `groups` equal groups kept (softmax: a group's
    best score; sigmoid: its best two), the top k, weights divided by their sum (`norm`) and scaled."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or (bias is not None and bias.dtype != torch.float32):
        raise ValueError(f"route reads fp32 logits [T, E] and an fp32 bias, got {logits.dtype} {tuple(logits.shape)}")
    tokens, experts = logits.shape
    if (not 0 < topk_groups <= groups or experts % groups or not 0 < k <= topk_groups * (experts // groups)
            or (bias is not None and bias.shape != (experts,))):
        raise ValueError(f"route: {k} of {experts} experts from the best {topk_groups} of {groups} groups cannot be "
                         f"chosen (bias {None if bias is None else tuple(bias.shape)})")
    logits = logits.contiguous()
    bias = bias.contiguous() if bias is not None else None
    weights, ids = torch.empty(tokens, k), torch.empty(tokens, k, dtype=torch.int64)
    _call(kernels, "ls_route", logits.data_ptr(), tokens, experts, k, int(sigmoid), groups, topk_groups,
          None if bias is None else bias.data_ptr(), int(norm), scaling, weights.data_ptr(), ids.data_ptr())
    return weights, ids


def int4_linear(kernels: NativeKernels, x: torch.Tensor, packed: torch.Tensor, group_size: int, out_features: int,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`[M, out_features]` = x `[M, K]` (`activations`) times the int4 weight `packed` by `pack_int4`; in `out_dtype`
    where the kernels write it, else fp32."""
    m, k = x.shape
    _check_int4(packed, out_features, k, group_size)
    dtype, io = _io(x, out_dtype)
    y = torch.empty(m, out_features, dtype=dtype)
    _call(kernels, "ls_int4_linear", x.data_ptr(), m, k, packed.data_ptr(), group_size, out_features, y.data_ptr(),
          io, torch.get_num_threads())
    return y


def experts_tokens(kernels: NativeKernels, x: torch.Tensor, weights: list[torch.Tensor], gates: torch.Tensor,
                   intermediate: int, bits: int, groups: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """`[T, K]` in x's dtype (fp32 or bf16): each token of x `[T, K]` (contiguous) through its gates.shape[1] routed
    experts, summed in fp32 with `gates` `[T, count]` (fp32) in their order; each token's result as it would be
    alone. `weights` per (token, expert): int8 (bits 8) gate_up q, scale, qsum, then down's; int4 the two packed
    weights, of group sizes `groups` (gate_up's, down's)."""
    tokens, count = gates.shape
    per = {8: 6, 4: 2}.get(bits)
    if per is None or len(weights) != tokens * count * per or x.shape[0] != tokens:
        raise ValueError(f"experts_tokens takes bits 8 or 4 and 6 or 2 weights per (token, expert), gates "
                         f"{tuple(gates.shape)} over {x.shape[0]} tokens; got bits {bits}, {len(weights)} weights")
    dtype, io = _io(x, x.dtype)
    y = torch.empty(tokens, x.shape[-1], dtype=dtype)
    pointers = (ctypes.c_void_p * len(weights))(*(w.data_ptr() for w in weights))
    _call(kernels, "ls_experts_tokens", x.data_ptr(), tokens, x.shape[-1], intermediate, count, pointers,
          gates.data_ptr(), bits, *groups, y.data_ptr(), io, torch.get_num_threads())
    return y


def mla_decode(kernels: NativeKernels, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, latent: int) -> torch.Tensor:
    """`[T, N, latent]` in q's dtype: absorbed MQA of q `[T, N, D]` over the paged cache `[blocks, block_size, D]`
    (fp32 or bf16 each), read in place through `block_table` (int32 `[R, *]`); request r's query tokens are
    query_start_loc[r] .. query_start_loc[r + 1] (int32), its length seq_lens[r] (int32)."""
    for name, t in (("q", q), ("kv_cache", kv_cache)):
        if t.dtype not in KERNEL_DTYPES:
            raise ValueError(f"mla_decode reads float32 or bfloat16 {name}, not {t.dtype}")
    for name, t in (("block_table", block_table), ("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        if t.dtype != torch.int32 or t.stride(-1) != 1:
            raise ValueError(f"mla_decode reads {name} as int32 with unit stride, got {t.dtype} {tuple(t.stride())}")
    q = q.contiguous()
    (tokens, heads, dim), block_size = q.shape, kv_cache.shape[1]
    if not kv_cache.is_contiguous() or kv_cache.shape[-1] != dim:
        raise ValueError(f"mla_decode reads a contiguous cache of rows of {dim}, got {tuple(kv_cache.shape)}")
    out = torch.empty(tokens, heads, latent, dtype=q.dtype)
    io = int(q.dtype == torch.bfloat16) | int(kv_cache.dtype == torch.bfloat16) << 1 | int(q.dtype == torch.bfloat16) << 2
    _call(kernels, "ls_mla_decode", q.data_ptr(), tokens, heads, dim, latent, kv_cache.data_ptr(), block_size,
          block_table.data_ptr(), block_table.stride(0), query_start_loc.data_ptr(), seq_lens.data_ptr(),
          seq_lens.shape[0], scale, out.data_ptr(), io, torch.get_num_threads())
    return out


INT4_BLOCK = 16  # outputs per block of `pack_int4`'s layout


def pack_int4(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """uint8 `[ceil(N / 16), groups * (64 + 8 * G)]` from q `[N, K]` in [0, 15] (K a multiple of 64) and fp32
    `scale`, `minimum` `[N, groups]` (G = K / groups): the outputs in blocks of 16 (zero rows pad the last), each
    block per group the 16 (scale, minimum) bf16 pairs, then per 8 columns 64 bytes whose byte 4j + i holds output
    j's column i (low nibble) and 4 + i (high) (int4.c)."""
    (n, k), groups = q.shape, scale.shape[1]
    g, pad = k // groups, -n % INT4_BLOCK
    q, scale, minimum = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, scale, minimum))
    blocks = (n + pad) // INT4_BLOCK
    units = q.view(blocks, INT4_BLOCK, groups, g // 8, 2, 4)  # [block, output, group, unit, low/high, column]
    nibbles = (units[..., 0, :] | (units[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).reshape(blocks, groups, 8 * g)
    pairs = torch.stack([scale, minimum], dim=-1).to(torch.bfloat16).view(torch.uint8)  # [N, groups, 4]
    pairs = pairs.view(blocks, INT4_BLOCK, groups, 4).transpose(1, 2).reshape(blocks, groups, 64)
    return torch.cat([pairs, nibbles], dim=2).view(blocks, -1)


def _check_int4(packed: torch.Tensor, n: int, k: int, group_size: int) -> None:
    """A weight in `pack_int4`'s layout of n outputs and k inputs, or a ValueError naming what differs."""
    if group_size not in (32, 64, 128) or k % 64 or k % group_size:
        raise ValueError(f"int4 kernels take group size 32, 64 or 128 dividing K, K a multiple of 64; got group size "
                         f"{group_size}, K {k}")
    expected = (-(-n // INT4_BLOCK), k // group_size * (64 + 8 * group_size))
    if packed.dtype != torch.uint8 or tuple(packed.shape) != expected or not packed.is_contiguous():
        raise ValueError(f"int4 weight of {n} outputs, {k} inputs, group size {group_size} is contiguous uint8 "
                         f"{expected} in pack_int4's layout; got {packed.dtype} {tuple(packed.shape)}")
