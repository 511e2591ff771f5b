"""The few-row weight products' read-ahead (quant.h read_ahead): set by the CPU's maker at load, it moves when the
weights arrive, never what is computed: every distance gives the same bits, in every build."""
from __future__ import annotations

import pytest
import torch

from latentserve.kernels import build, cpu, native
from latentserve.layers.quant.int4 import quantize_int4
from latentserve.layers.quant.int8 import quantize_int8
from tests.kernels.builds import ISAS, kernels, needs_a_build
from tests.kernels.test_file_blocks import FORMATS

# 0: none; 64: inside the unit's own group; 192: not a whole group of int4 (rounded up); 2048: Intel's; 1 MiB: past
# the end of every weight here (a prefetch does not fault).
DISTANCES = (0, 64, 192, 2048, 1 << 20)


@pytest.fixture
def set_read_ahead():
    libs = []

    def set_(k: native.NativeKernels, bytes_: int) -> None:
        libs.append(k.lib)
        k.lib.ls_set_read_ahead(bytes_)

    yield set_
    for lib in libs:
        lib.ls_set_read_ahead(build.read_ahead_bytes())


def _product(fmt: str, g: torch.Generator, n: int, width: int):
    """x -> x times a weight of `fmt` (n outputs, `width` inputs), on kernels k."""
    if fmt in FORMATS:
        f = FORMATS[fmt]
        packed = f.pack(*f.values(g, n, width)[0])
        return lambda k, x: f.linear(k, x, packed, n)
    w = torch.randn(n, width, generator=g) * 0.05
    if fmt == "int8":
        packed = native.pack_int8(*quantize_int8(w))
        return lambda k, x: native.int8_linear(k, x, packed, n)
    packed = native.pack_int4(*quantize_int4(w, 32))
    return lambda k, x: native.int4_linear(k, x, packed, 32, n)


@needs_a_build
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", ["int8", "int4", "Q6_K", "Q3_K", "Q2_K", "Q5_0", "Q5_1", "Q5_K", "Q4_K"])
def test_every_read_ahead_gives_the_same_bits(isa, fmt, set_read_ahead):
    k = kernels(isa)
    g = torch.Generator().manual_seed(len(fmt))
    n, width = 16 * 7, 512  # 7 blocks: a share with a pair and one block alone on each of 2 threads
    product = _product(fmt, g, n, width)
    for rows in (1, 2, 3, 8, 9):  # pairs at 1-8 rows (two chains at 1-2, int4's halves from 3), single blocks above
        x = torch.randn(rows, width, generator=g)
        outputs = []
        for distance in DISTANCES:
            set_read_ahead(k, distance)
            outputs.append(product(k, x))
        for distance, y in zip(DISTANCES[1:], outputs[1:]):
            assert torch.equal(y, outputs[0]), (rows, distance)


@pytest.mark.parametrize("vendor, expected", [("GenuineIntel", 2048), ("AuthenticAMD", 0), ("HygonGenuine", 0),
                                              ("", 0)])
def test_the_read_ahead_is_the_makers(monkeypatch, vendor, expected):
    monkeypatch.setattr(build, "cpu_vendor", lambda: vendor)
    assert build.read_ahead_bytes() == expected


def test_the_vendor_is_read_from_cpuinfo(monkeypatch, tmp_path):
    fake = tmp_path / "cpuinfo"
    fake.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nflags\t\t: fpu avx2 avx512f\n")
    real_open = open
    monkeypatch.setattr(cpu, "open", lambda path, *a, **kw: real_open(fake if path == "/proc/cpuinfo" else path, *a,
                                                                      **kw), raising=False)
    cpu.cpu_vendor.cache_clear()
    cpu.cpu_flags.cache_clear()
    try:
        assert cpu.cpu_vendor() == "AuthenticAMD"
        assert cpu.cpu_flags() == {"fpu", "avx2", "avx512f"}
    finally:
        cpu.cpu_vendor.cache_clear()
        cpu.cpu_flags.cache_clear()
