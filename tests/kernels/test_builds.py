"""Every build this CPU can run compiles (a source that stops compiling would otherwise only make the kernel tests
skip: their callers fall back to PyTorch's kernels), and the build cache trusts only what this user wrote. The cache
tests compile with a stand-in compiler (a script copying a library) so that they take milliseconds."""
from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import stat
import subprocess

import pytest

from latentserve.kernels import build, native
from latentserve.kernels.cpu import cpu_features
from tests.kernels.builds import ISAS, kernels, needs_a_compiler

ISA = ISAS[0] if ISAS else "avx2"
FAKE_CC = """#!/bin/sh
echo run >> "$FAKE_CC_LOG"
while [ $# -gt 1 ]; do [ "$1" = "-o" ] && out="$2"; shift; done
[ -n "$FAKE_CC_SLEEP" ] && sleep "$FAKE_CC_SLEEP"
cp "$FAKE_CC_LIBRARY" "$out"
"""


@needs_a_compiler
@pytest.mark.parametrize("isa", ISAS)
def test_every_runnable_build_compiles(isa):
    built = native.load(isa)
    if isinstance(built, str) and isa in native.FALLBACK and ("avx512bf16" in built or "amx" in built):
        pytest.skip(f"this compiler has no {isa} (the engine falls back to {native.FALLBACK[isa]}): {built}")
    assert not isinstance(built, str), built
    assert hasattr(built.lib, "ls_moe_block") and hasattr(built.lib, "ls_experts")


@pytest.mark.parametrize("isa", ISAS)
def test_only_the_ls_interface_is_exported(isa):
    """-fvisibility=hidden: helpers such as quantize_acts cannot bind to another library's symbol of that name."""
    if shutil.which("nm") is None:
        pytest.skip("no nm")
    listed = subprocess.run(["nm", "-D", "--defined-only", kernels(isa).lib._name], capture_output=True, text=True,
                            check=True).stdout
    names = [line.split()[-1] for line in listed.splitlines() if line.split()[1:2] == ["T"]]
    assert "ls_mla_decode" in names and "quantize_acts" not in names
    assert [n for n in names if not n.startswith("ls_")] == []


def _other_library() -> str:
    """A shared library without the kernels' symbols: this process's libm."""
    with open("/proc/self/maps") as maps:
        return next(line.split()[-1] for line in maps if "/libm." in line or "/libm-" in line)


@pytest.fixture
def fake_cc(monkeypatch, tmp_path):
    """CC set to a two-word command (sh SCRIPT, split as a shell splits it) that copies `library` to its -o path;
    returns (a function setting what it copies, the number of runs so far)."""
    script, log = tmp_path / "fake-cc.sh", tmp_path / "runs"
    script.write_text(FAKE_CC)
    log.touch()
    monkeypatch.setenv("CC", f"sh {script}")
    monkeypatch.setenv("FAKE_CC_LOG", str(log))
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(build.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir(mode=0o700)

    def copying(library: str):
        monkeypatch.setenv("FAKE_CC_LIBRARY", library)
        return lambda: len(log.read_text().splitlines())

    return copying


def test_a_cc_of_several_words_is_split_as_a_shell_would(monkeypatch):
    monkeypatch.setenv("CC", "ccache gcc -O1 '-DNAME=a b'")
    assert build._compiler() == ["ccache", "gcc", "-O1", "-DNAME=a b"]


def test_a_build_is_private_and_renamed_into_place(fake_cc, tmp_path):
    runs = fake_cc(kernels(ISA).lib._name)
    stale = tmp_path / "cache" / "kernels" / "old.so.partial"
    stale.parent.mkdir(parents=True, mode=0o700)
    stale.touch()
    os.utime(stale, (0, 0))  # left by a compiler killed long ago
    young = stale.with_name("running.so.partial")
    young.touch()  # another process's build in progress: kept
    path = build._build(ISA)
    assert runs() == 1 and path.parent == tmp_path / "cache" / "kernels"
    assert stat.S_IMODE(path.stat().st_mode) & 0o022 == 0
    assert not stale.exists() and young.exists()
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([path.name, young.name])
    assert build._build(ISA) == path and runs() == 1  # cached


def test_a_fresh_cache_dir_is_created_private(fake_cc, tmp_path):
    fake_cc(kernels(ISA).lib._name)
    path = build._build(ISA)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


@pytest.mark.parametrize("how", ["world-writable", "not ours"])
def test_an_untrusted_cache_dir_is_not_used(fake_cc, tmp_path, monkeypatch, caplog, how):
    """A library under the predictable cache name in a directory others can write could be anyone's."""
    runs = fake_cc(kernels(ISA).lib._name)
    shared = tmp_path / "cache" / "kernels"
    shared.mkdir(parents=True)
    real = os.getuid()
    if how == "world-writable":
        shared.chmod(0o777)
    else:  # we pretend to be another user: everything here is then someone else's
        monkeypatch.setattr(build.os, "getuid", lambda: real + 1)
    with caplog.at_level(logging.WARNING, logger=build.log.name):
        path = build._build(ISA)
    assert runs() == 1 and path.parent != shared and not any(shared.iterdir())
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert f"not caching builds in {shared}" in caplog.text
    why = "mode 777: others can write it" if how == "world-writable" else f"owned by uid {real}, not {real + 1}"
    assert why in caplog.text


@pytest.mark.parametrize("damage", ["empty", "no symbols"])
def test_a_broken_cached_build_is_deleted_and_built_once_more(fake_cc, tmp_path, caplog, damage):
    """A compiler killed mid-write or a full disk leaves a library that does not load: rebuilt once, not kept."""
    good = kernels(ISA).lib._name
    runs = fake_cc(good)
    path = build._build(ISA)
    if damage == "empty":
        path.write_bytes(b"")
    else:
        shutil.copy(_other_library(), path)
    with caplog.at_level(logging.INFO, logger=build.log.name):
        built = build.load.__wrapped__(ISA)
    assert runs() == 2 and not isinstance(built, str) and built.lib.ls_mla_decode
    assert "does not load" in caplog.text and "building it again" in caplog.text


def test_a_build_that_never_loads_falls_back_with_a_reason(fake_cc, caplog):
    runs = fake_cc(_other_library())
    with caplog.at_level(logging.WARNING, logger=build.log.name):
        why = build.load.__wrapped__(ISA)
    assert runs() == 2 and isinstance(why, str) and "does not load" in why and "ls_" in why


def test_a_hung_compiler_times_out(fake_cc, monkeypatch):
    fake_cc(kernels(ISA).lib._name)
    monkeypatch.setenv("FAKE_CC_SLEEP", "5")
    monkeypatch.setattr(build, "COMPILE_TIMEOUT_S", 0.5)
    with pytest.raises(RuntimeError, match="did not finish in 0.5 s"):
        build._build(ISA)


def test_a_failed_build_names_why_and_layers_keep_torch_kernels(monkeypatch, tmp_path, caplog):
    monkeypatch.delenv(native.NATIVE_ENV, raising=False)  # the build is tried: no developer's setting skips it
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")
    build.load.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=build.log.name):
            built, why = native.native_kernels(cpu_features())
        assert built is None and "build unavailable" in why and "/bin/false failed" in why
        assert "PyTorch's kernels run" in caplog.text
    finally:
        build.load.cache_clear()
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    assert native.native_kernels(cpu_features()) == (None, f"{native.NATIVE_ENV}=0")
    monkeypatch.setenv(native.NATIVE_ENV, "off")
    with pytest.raises(ValueError, match="LATENTSERVE_NATIVE_KERNELS='off': use 1 .*, 0 .* or a build's name"):
        native.native_kernels(cpu_features())


def test_avx512_builds_fall_back_to_the_next_that_compiles(monkeypatch):
    """A compiler that cannot build AVX512-BF16 code still gives an AVX-512 machine its VNNI kernels, and one that
    builds no AVX-512 at all the AVX2 ones."""
    monkeypatch.delenv(native.NATIVE_ENV, raising=False)
    features = dataclasses.replace(cpu_features(), capability="AVX512", vnni=True, avx512_bf16=True, amx=False)
    assert native.kernel_isa(features)[0] == "avx512_bf16"
    vnni, avx2 = object(), object()
    monkeypatch.setattr(build, "load", lambda isa: "no -mavx512bf16" if isa == "avx512_bf16" else vnni)
    built, why = native.native_kernels(features)
    assert built is vnni and "avx512_bf16 build unavailable (no -mavx512bf16)" in why
    assert native.kernel_isa(dataclasses.replace(features, avx512_bf16=False))[0] == "avx512_vnni"
    monkeypatch.setattr(build, "load", lambda isa: avx2 if isa == "avx2" else f"no {isa}")
    built, why = native.native_kernels(features)
    assert built is avx2 and "avx512_vnni build unavailable (no avx512_vnni)" in why


def test_a_cpu_with_avx_vnni_runs_the_avx2_vnni_build(monkeypatch):
    """AVX-VNNI without AVX-512 (Intel's client CPUs) runs avx2_vnni, which falls back to AVX2 where it does not
    compile and reads AVX2's packed weights; an AVX-512 machine keeps its AVX-512 builds first."""
    monkeypatch.delenv(native.NATIVE_ENV, raising=False)
    client = dataclasses.replace(cpu_features(), capability="AVX2", vnni=True, avx512_bf16=False, amx=False,
                                 avx_vnni=True)
    assert native.kernel_isa(client) == ("avx2_vnni", "AVX2 with AVX-VNNI")
    assert native.runnable_isas(client) == ["avx2_vnni", "avx2"]
    assert native.kernel_isa(dataclasses.replace(client, avx_vnni=False))[0] == "avx2"
    server = dataclasses.replace(client, capability="AVX512", avx512_bf16=True)
    assert native.runnable_isas(server) == ["avx512_bf16", "avx512_vnni", "avx2_vnni", "avx2"]
    avx2 = object()
    monkeypatch.setattr(build, "load", lambda isa: avx2 if isa == "avx2" else "no -mavxvnni")
    built, why = native.native_kernels(client)
    assert built is avx2 and "avx2_vnni build unavailable (no -mavxvnni)" in why
    assert native.NativeKernels("avx2_vnni", None).layout == "avx2"


def test_the_environment_names_a_build_this_cpu_runs(monkeypatch):
    """LATENTSERVE_NATIVE_KERNELS=<build> picks it (plain AVX2 on a CPU with AVX-VNNI, to compare); a build the CPU
    cannot run, or no build of that name, is refused with what it runs."""
    client = dataclasses.replace(cpu_features(), capability="AVX2", vnni=True, avx512_bf16=False, amx=False,
                                 avx_vnni=True)
    monkeypatch.setenv(native.NATIVE_ENV, "avx2")
    assert native.kernel_isa(client) == ("avx2", f"{native.NATIVE_ENV}=avx2")
    monkeypatch.setenv(native.NATIVE_ENV, "avx512_vnni")
    with pytest.raises(ValueError, match="avx512_vnni: this CPU .* runs avx2_vnni, avx2"):
        native.kernel_isa(client)
    monkeypatch.setenv(native.NATIVE_ENV, "avx3")
    with pytest.raises(ValueError, match="'avx3': use 1 .*, 0 .* or a build's name: avx512_vnni, avx2, avx2_vnni"):
        native.kernel_isa(client)


def test_the_build_key_covers_every_source_and_header():
    """A cached library is keyed by its sources and headers: a file left out would leave a stale build after edits."""
    assert {p.name for p in build.KERNEL_DIR.glob("*.h")} == {p.name for p in build.HEADERS}
    assert {p.name for p in build.KERNEL_DIR.glob("*.c")} == {p.name for p in build.SOURCES}
