"""Building and loading latentserve's kernels: compiled with the system C compiler on first use, per instruction set,
cached in a directory only this user can write, and loaded through ctypes. Where they cannot be built the callers
keep PyTorch's kernels; every choice is logged (docs/kernels.md)."""
from __future__ import annotations

import _ctypes
import ctypes
import functools
import hashlib
import logging
import os
import shlex
import shutil
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from latentserve.kernels import abi
from latentserve.kernels.cpu import CpuFeatures, cpu_vendor

log = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).parent
SOURCES = tuple(KERNEL_DIR / name for name in ("quant_acts.c", "qgemm.c", "int4.c", "q6k.c", "q45.c", "amx.c",
                                               "amx_blocks.c", "quant_blocks.c", "experts.c", "gemv.c", "mla_decode.c",
                                               "prefill_attention.c", "norm.c", "prologue.c", "attention_block.c",
                                               "route.c", "moe_block.c", "decode_layers.c", "argmax.c", "bounds.c",
                                               "scratch.c", "api.c"))
HEADERS = (KERNEL_DIR / "latentserve.h", KERNEL_DIR / "simd.h", KERNEL_DIR / "quant.h", KERNEL_DIR / "kv_rows.h",
           KERNEL_DIR / "mla_tiles.h", KERNEL_DIR / "mla_lanes.h", KERNEL_DIR / "int8_nibbles.h",
           KERNEL_DIR / "int8_vnni256.h", KERNEL_DIR / "q45.h", KERNEL_DIR / "q6k.h")
# "0" keeps PyTorch's kernels (_int_mm, int4pack_mm) even where these build, e.g. to compare them; "1" (default) not.
NATIVE_ENV = "LATENTSERVE_NATIVE_KERNELS"
CACHE_ENV = "LATENTSERVE_CACHE_DIR"
ISA_FLAGS = {
    "avx512_vnni": ["-DLS_AVX512", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512vnni"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],  # F16C (Q5_0's fp16 scales): on every AVX2 CPU, as FMA
}
# AVX2 with AVX-VNNI (Intel's client CPUs from Alder Lake, without AVX-512): the int8 and int4 products through
# vpdpbusd on 256 bits (int8_vnni256.h), the AVX2 build's layouts and its other kernels.
ISA_FLAGS["avx2_vnni"] = ISA_FLAGS["avx2"] + ["-mavxvnni", "-DLS_AVXVNNI"]
# The same with AVX512-BF16: bf16 products (decode attention, few-row linears, experts' gate and up) through
# vdpbf16ps.
ISA_FLAGS["avx512_bf16"] = ISA_FLAGS["avx512_vnni"] + ["-mavx512bf16", "-DLS_BF16DOT"]
# The same with AMX tiles: the int8 and int4 blocks' products at many rows (prefill) through TDPBUSD / TDPBSUD
# (amx.c), equal to the avx512_bf16 build's to the bit.
ISA_FLAGS["avx512_amx"] = ISA_FLAGS["avx512_bf16"] + ["-mamx-tile", "-mamx-int8", "-DLS_AMX"]
# Where a compiler cannot build the first (or, for AMX, the OS will not grant its state), the second still runs.
FALLBACK = {"avx512_amx": "avx512_bf16", "avx512_bf16": "avx512_vnni", "avx512_vnni": "avx2", "avx2_vnni": "avx2"}
# Builds whose tiles need the OS's permission (ls_enable_amx) before any kernel runs.
AMX_ISAS = ("avx512_amx",)
# No fused multiply-adds but the kernels' explicit ones: prologue.c's rotation rounds as torch's elementwise ops do.
# Hidden symbols but the ls_ interface (LS_API): the library's helpers cannot clash with another library's.
CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-fvisibility=hidden", "-shared", "-fPIC"]
# How far ahead the few-row weight products fetch their weights into L1 (quant.h read_ahead), by the CPU's maker, not
# its instruction set: on an Intel Xeon 2 KB ran them 1.04-1.78x faster at 1-8 rows (4 KB the same, 1 KB slower); on
# AMD Zen 4 a whole batch-1 decode ran 1.13-1.19x faster with none, the hardware prefetchers alone, in both the
# AVX-512 and the AVX2 build (benchmarks/RESULTS.md "Read-ahead by CPU maker"). Other makers get none: not measured.
READ_AHEAD = {"GenuineIntel": 2048}
COMPILE_TIMEOUT_S = 600  # a build takes ~20 s, minutes under the sanitizers; a hung compiler must not hang the engine
NOT_OTHERS = 0o022  # group and others' write bits: a directory or library with either set is not trusted


@dataclass(frozen=True)
class NativeKernels:
    isa: str
    lib: ctypes.CDLL

    @property
    def bf16_dot(self) -> bool:
        """Whether bf16 products multiply through vdpbf16ps (the avx512_bf16 build and the AMX one above it)."""
        return self.isa in ("avx512_bf16", "avx512_amx")

    @property
    def read_ahead(self) -> int:
        """The bytes the few-row weight products fetch ahead on this CPU (0: none), as _open set them."""
        return read_ahead_bytes()

    @property
    def layout(self) -> str:
        """The packed weights' layout, named by the build that defines it: the AMX build reads avx512_bf16's, the
        avx2_vnni one AVX2's."""
        return {"avx512_amx": "avx512_bf16", "avx2_vnni": "avx2"}.get(self.isa, self.isa)


# Why each build is the one this CPU runs.
CHOSEN_FOR = {"avx512_amx": "AVX-512 with VNNI, BF16 and AMX", "avx512_bf16": "AVX-512 with VNNI and BF16",
              "avx512_vnni": "AVX-512 with VNNI", "avx2_vnni": "AVX2 with AVX-VNNI"}


def runnable_isas(features: CpuFeatures) -> list[str]:
    """The builds this CPU runs, the fastest first: each AVX-512 build on an AVX-512 machine with VNNI (the AMX one
    where it has BF16 and AMX too), then avx2_vnni where it has AVX-VNNI, then AVX2."""
    isas = []
    if features.capability.startswith("AVX512") and features.vnni:
        isas += ["avx512_amx"] if features.avx512_bf16 and features.amx else []
        isas += ["avx512_bf16"] if features.avx512_bf16 else []
        isas.append("avx512_vnni")
    if features.capability.startswith(("AVX512", "AVX2")):
        isas += ["avx2_vnni"] if features.avx_vnni else []
        isas.append("avx2")
    return isas


def kernel_isa(features: CpuFeatures) -> tuple[str | None, str]:
    """(instruction set to build for, why) from what torch dispatches on: `ATEN_CPU_CAPABILITY=avx2` picks an AVX2
    build on an AVX-512 machine, as it does torch's own kernels; `LATENTSERVE_NATIVE_KERNELS=<build>` names one (of
    those this CPU runs), e.g. plain AVX2 on a CPU with AVX-VNNI."""
    setting, runnable = os.environ.get(NATIVE_ENV, "1"), runnable_isas(features)
    if setting not in ("0", "1", *ISA_FLAGS):
        raise ValueError(f"{NATIVE_ENV}={setting!r}: use 1 (latentserve's kernels where they build), 0 (PyTorch's) "
                         f"or a build's name: {', '.join(ISA_FLAGS)}")
    if setting == "0":
        return None, f"{NATIVE_ENV}=0"
    if setting in ISA_FLAGS:
        if setting not in runnable:
            raise ValueError(f"{NATIVE_ENV}={setting}: this CPU ({features.describe()}) runs "
                             f"{', '.join(runnable) or 'none of the builds'}")
        return setting, f"{NATIVE_ENV}={setting}"
    if not runnable:
        return None, f"capability {features.capability}: no vector build"
    isa = runnable[0]
    if isa == "avx2":
        return isa, f"{features.capability} without VNNI" if features.capability != "AVX2" else "AVX2"
    return isa, CHOSEN_FOR[isa]


def untrusted(directory: Path) -> str | None:
    """Why a library found in `directory` could have been written by someone else, or None: the directory must be
    ours and writable by no one else, and each directory above it ours or root's and writable by no one else unless
    sticky (as /tmp is: others cannot rename what is ours there)."""
    uid = os.getuid()
    st = directory.stat()
    if st.st_uid != uid:
        return f"{directory} is owned by uid {st.st_uid}, not {uid}"
    if st.st_mode & NOT_OTHERS:
        return f"{directory} has mode {stat.S_IMODE(st.st_mode):o}: others can write it"
    for parent in directory.resolve().parents:
        st = parent.stat()
        if st.st_uid not in (0, uid):
            return f"{parent} is owned by uid {st.st_uid}"
        if st.st_mode & NOT_OTHERS and not st.st_mode & stat.S_ISVTX:
            return f"{parent} has mode {stat.S_IMODE(st.st_mode):o}: others can replace what it holds"
    return None


def _configured_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "latentserve")
    return Path(root).expanduser() / "kernels"


def _private(directory: Path) -> str | None:
    """`directory` created (0700) where missing; why it is not trusted, or None."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        return untrusted(directory)
    except OSError as e:
        return f"{directory}: {e.strerror or e}"


@functools.cache
def _trusted_dir(configured: Path) -> Path:
    why = _private(configured)
    if why is None:
        return configured
    fallback = Path(tempfile.gettempdir()) / f"latentserve-{os.getuid()}" / "kernels"
    if _private(fallback) is not None:
        fallback = Path(tempfile.mkdtemp(prefix="latentserve-kernels-"))  # 0700, ours, this process's alone
    log.warning("latentserve kernels: not caching builds in %s (%s); building in %s instead", configured, why,
                fallback)
    return fallback


def cache_dir() -> Path:
    """Where builds are cached: `LATENTSERVE_CACHE_DIR`/kernels (default ~/.cache/latentserve/kernels) where it is
    trusted (`untrusted`), else a private directory of our own."""
    return _trusted_dir(_configured_dir())


def _compiler() -> list[str]:
    """The compiler's command line: `CC` split as a shell would (`CC="ccache gcc"`), else cc or gcc."""
    words = shlex.split(os.environ.get("CC", ""))
    if not words:
        found = shutil.which("cc") or shutil.which("gcc")
        if found is None:
            raise RuntimeError("no C compiler (cc or gcc) on PATH")
        words = [found]
    return words


def _remove_stale_partials(directory: Path) -> None:
    """Partial builds older than any build can take: left by a killed compiler (a running build's is younger)."""
    for path in directory.glob("*.partial"):
        try:
            if time.time() - path.stat().st_mtime > 2 * COMPILE_TIMEOUT_S:
                path.unlink()
        except OSError:
            pass  # another process removed or renamed it first


def _build(isa: str) -> Path:
    """The shared library for `isa`, compiled unless a build of this source with these flags is cached."""
    compiler, flags = _compiler(), CFLAGS + ISA_FLAGS[isa]
    text = b"".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    key = hashlib.sha256(text + " ".join([*compiler, *flags]).encode()).hexdigest()[:16]
    directory = cache_dir()
    target = directory / f"kernels-{isa}-{key}.so"
    _remove_stale_partials(directory)
    if target.is_file():
        st = target.stat()
        if st.st_uid == os.getuid() and not st.st_mode & NOT_OTHERS:
            return target
        log.warning("latentserve kernels: %s is not ours or others can write it: rebuilding it", target)
        target.unlink()
    # Built under a name of its own and renamed into place: processes that build at once never load a partial file.
    fd, partial = tempfile.mkstemp(dir=directory, prefix=target.name + ".", suffix=".partial")
    os.close(fd)
    log.info("latentserve kernels: compiling the %s build with %s", isa, " ".join(compiler))
    try:
        try:
            done = subprocess.run([*compiler, *flags, *map(str, SOURCES), "-o", partial], capture_output=True,
                                  text=True, timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{' '.join(compiler)} did not finish in {COMPILE_TIMEOUT_S} s") from None
        if done.returncode:
            raise RuntimeError(f"{' '.join(compiler)} failed: {done.stderr.strip()[-400:]}")
        os.chmod(partial, 0o755)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def _open(path: Path) -> ctypes.CDLL:
    """The library at `path` with its interface declared (abi.py); an OSError or AttributeError (a missing symbol)
    where it is not a whole build, an abi.LayoutMismatch where its structs differ from abi.py's (closed again, so
    that a rebuild at the same path is not answered with this one)."""
    lib = ctypes.CDLL(str(path))  # ctypes releases the GIL during calls: DBO's ubatch threads overlap
    try:
        abi.declare(lib)
    except (AttributeError, abi.LayoutMismatch):
        _ctypes.dlclose(lib._handle)
        raise
    lib.ls_set_read_ahead(read_ahead_bytes())
    return lib


def read_ahead_bytes() -> int:
    """READ_AHEAD's bytes for this CPU."""
    return READ_AHEAD.get(cpu_vendor(), 0)


@functools.cache
def load(isa: str) -> NativeKernels | str:
    """The kernels for `isa`, built (or found cached) and loaded; or why they cannot be (remembered: one try). A
    cached library that does not load (a compiler killed mid-write, a full disk) is deleted and built once more."""
    for attempt in range(2):
        try:
            path = _build(isa)
        except (OSError, RuntimeError) as e:
            log.warning("latentserve kernels: the %s build is unavailable: %s", isa, e)
            return str(e)
        try:
            lib = _open(path)
        except abi.LayoutMismatch as e:  # the sources and abi.py disagree: a rebuild would too
            log.warning("latentserve kernels: refusing the %s build %s: %s", isa, path, e)
            return f"{path}: {e}"
        except (OSError, AttributeError) as e:
            why = f"{path} does not load ({e})"
            log.warning("latentserve kernels: %s: deleting it%s", why, "" if attempt else " and building it again")
            path.unlink(missing_ok=True)
            continue
        if isa in AMX_ISAS and lib.ls_enable_amx() != abi.OK:
            why = f"no AMX in this process: {lib.ls_last_error().decode()}"
            log.warning("latentserve kernels: refusing the %s build: %s", isa, why)
            return why
        log.info("latentserve kernels: loaded the %s build from %s", isa, path)
        return NativeKernels(isa, lib)
    return why


@functools.cache
def _log_once(level: int, message: str) -> None:
    log.log(level, message)


def native_kernels(features: CpuFeatures) -> tuple[NativeKernels | None, str]:
    """(the kernels for this CPU or None, why)."""
    isa, why = kernel_isa(features)
    if isa is None:
        _log_once(logging.INFO, f"latentserve kernels: not used ({why}): PyTorch's kernels run")
        return None, why
    kernels = load(isa)
    while isinstance(kernels, str) and isa in FALLBACK:
        why = f"{why}; {isa} build unavailable ({kernels})"
        isa = FALLBACK[isa]
        kernels = load(isa)
    if isinstance(kernels, str):
        why = f"{isa} build unavailable: {kernels}"
        _log_once(logging.WARNING, f"latentserve kernels: {why}: PyTorch's kernels run")
        return None, why
    _log_once(logging.INFO, f"latentserve kernels: the {isa} build runs ({why})")
    return kernels, why
