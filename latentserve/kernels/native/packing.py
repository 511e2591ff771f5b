"""The quantized weights' layouts the kernels read, blocks of 16 outputs: `pack_int8`'s (qgemm.c), `pack_int4`'s
(int4.c), `pack_q6k`'s, `pack_q3k`'s and `pack_q2k`'s (q6k.c), `pack_q50`'s, `pack_q5k`'s and `pack_q4k`'s (q45.c), and
the checks that a packed weight has the shape its layout gives it."""
from __future__ import annotations

import torch

from latentserve.kernels.checks import tensor
from latentserve.kernels.native.calls import I8, U8


INT4_BLOCK = INT8_BLOCK = Q6K_BLOCK = Q50_BLOCK = 16  # outputs per block of the `pack_*` layouts
INT8_HEADER = 128  # bytes before a `pack_int8` block's weights: 16 fp32 scales, 16 int32 sums of q


def int8_lanes(q: torch.Tensor) -> torch.Tensor:
    """int8 q `[H, N, K]` (N % 16 == 0, K % 4 == 0) in `int8_heads_lanes`' layout `[H, N / 16, K / 4, 16, 4]`."""
    h, n, k = q.shape
    if q.dtype != torch.int8 or n % 16 or k % 4:
        raise ValueError(f"int8_lanes takes int8 [H, N, K] with N % 16 == 0 and K % 4 == 0, not {q.dtype} "
                         f"{tuple(q.shape)}")
    return q.view(h, n // 16, 16, k // 4, 4).transpose(2, 3).contiguous()


def pack_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 `[ceil(N / 16), 128 + 16 * K]` from q int8 `[N, K]` (K a multiple of 4) and its fp32 `scale` `[N]`: the
    outputs in blocks of 16 (zero rows pad the last), each block the 16 scales, the 16 int32 sums of q's rows, then
    per 4 columns 64 bytes whose byte 4j + i is output j's column 4c + i (`int8_lanes`; qgemm.c)."""
    n, k = q.shape
    if q.dtype != torch.int8 or k % 4 or scale.shape != (n,):
        raise ValueError(f"pack_int8 takes int8 q [N, K] with K % 4 == 0 and fp32 scale [N], not {q.dtype} "
                         f"{tuple(q.shape)} and {tuple(scale.shape)}")
    pad = -n % INT8_BLOCK
    q, scale = torch.nn.functional.pad(q, (0, 0, 0, pad)), torch.nn.functional.pad(scale.float(), (0, pad))
    blocks = (n + pad) // INT8_BLOCK
    header = torch.cat([scale.view(blocks, INT8_BLOCK), q.sum(dim=1, dtype=torch.int32).view(torch.float32)
                        .view(blocks, INT8_BLOCK)], dim=1).view(torch.int8)
    return torch.cat([header, int8_lanes(q[None])[0].view(blocks, -1)], dim=1)


def unpack_int8(packed: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q `[n, k]`, scale `[n]`) back from `pack_int8`'s layout."""
    blocks = packed.shape[0]
    scale = packed[:, :64].contiguous().view(torch.float32).reshape(-1)[:n]
    lanes = packed[:, INT8_HEADER:].reshape(blocks, k // 4, INT8_BLOCK, 4)
    return lanes.transpose(1, 2).reshape(blocks * INT8_BLOCK, k)[:n], scale


def check_int8(fn: str, name: str, packed: torch.Tensor, n: int, k: int) -> None:
    """A weight in `pack_int8`'s layout of n outputs and k inputs, or a ValueError naming what differs."""
    if k % 4:
        raise ValueError(f"{fn}: the int8 kernels take K a multiple of 4; got K {k}")
    tensor(fn, f"{name} (int8 weight of {n} outputs, {k} inputs in pack_int8's layout)", packed, I8,
           (-(-n // INT8_BLOCK), INT8_HEADER + INT8_BLOCK * k))


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


def check_int4(fn: str, name: str, packed: torch.Tensor, n: int, k: int, group_size: int) -> None:
    """A weight in `pack_int4`'s layout of n outputs and k inputs, or a ValueError naming what differs."""
    if group_size not in (32, 64, 128) or k % 64 or k % group_size:
        raise ValueError(f"{fn}: int4 kernels take group size 32, 64 or 128 dividing K, K a multiple of 64; got group "
                         f"size {group_size}, K {k}")
    expected = (-(-n // INT4_BLOCK), k // group_size * (64 + 8 * group_size))
    tensor(fn, f"{name} (int4 weight of {n} outputs, {k} inputs, group size {group_size} in pack_int4's layout)",
           packed, U8, expected)


Q6K_SUPER = 64 + 16 * 16 + 16 * 192  # bytes of 256 columns of a `pack_q6k` block
Q6K_FORMAT = (6, 16)  # the experts' format tuple (bits, group) of `pack_q6k`'s layout


def _q6k_heads(fn: str, q: torch.Tensor, d: torch.Tensor, sc: torch.Tensor, q_top: int,
               sc_range: tuple[int, int] | None, file_type: str) -> tuple[int, int, torch.Tensor, torch.Tensor,
                                                                       torch.Tensor]:
    """(blocks, super-blocks, q padded with zero rows to whole blocks of 16, per block and super-block the 64 bytes of
    d and the 256 of sc (group-major)) of values w = d * sc * (q - centre) as `fn` takes them (q in [0, q_top], sc in
    sc_range where int8's whole range is not the format's), or a ValueError naming what it got."""
    n, k = q.shape
    if (q.dtype != torch.uint8 or k % 256 or d.dtype != torch.float32 or d.shape != (n, k // 256)
            or sc.dtype != torch.int8 or sc.shape != (n, k // 16)):
        raise ValueError(f"{fn} takes uint8 q [N, K] with K % 256 == 0, fp32 d [N, K / 256] and int8 sc "
                         f"[N, K / 16], not {q.dtype} {tuple(q.shape)}, {d.dtype} {tuple(d.shape)}, {sc.dtype} "
                         f"{tuple(sc.shape)}")
    if q.numel() and int(q.max()) > q_top:
        raise ValueError(f"{fn}: q holds {int(q.max())}, past {file_type}'s {q_top}")
    if sc_range and sc.numel() and not sc_range[0] <= int(sc.min()) <= int(sc.max()) <= sc_range[1]:
        raise ValueError(f"{fn}: sc holds {int(sc.min())} .. {int(sc.max())}, past {file_type}'s "
                         f"{sc_range[0]} .. {sc_range[1]}")
    pad = -n % Q6K_BLOCK
    blocks, supers = (n + pad) // Q6K_BLOCK, k // 256
    q, d, sc = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, d, sc))
    d = d.contiguous().view(blocks, Q6K_BLOCK, supers).transpose(1, 2).contiguous().view(torch.uint8)
    sc = sc.view(blocks, Q6K_BLOCK, supers, 16).permute(0, 2, 3, 1).contiguous().view(torch.uint8)
    return blocks, supers, q, d.view(blocks, supers, 64), sc.view(blocks, supers, 256)


def pack_q6k(q: torch.Tensor, d: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """uint8 `[ceil(N / 16), K / 256 * 3392]` from llama.cpp's Q6_K values w = d * sc * (q - 32): q `[N, K]` in
    [0, 63] (K a multiple of 256), fp32 `d` `[N, K / 256]`, int8 `sc` `[N, K / 16]`. The outputs in blocks of 16 (zero
    rows pad the last), each block per 256 columns the 16 d, the 16 x 16 sc (group-major), then per 16 columns three
    64-byte units, byte 4j + i of unit u output j's column 4u + i in its low 6 bits and bits 2u, 2u + 1 of its
    column 12 + i in the top 2 (q6k.c)."""
    blocks, supers, q, d, sc = _q6k_heads("pack_q6k", q, d, sc, 63, None, "Q6_K")
    # [block, output, super-block, group, quarter of the group, column]
    q = q.view(blocks, Q6K_BLOCK, supers, 16, 4, 4)
    last = q[..., 3, :]
    units = torch.stack([q[..., 0, :] | ((last & 3) << 6), q[..., 1, :] | (((last >> 2) & 3) << 6),
                         q[..., 2, :] | ((last >> 4) << 6)], dim=4)  # [block, output, super-block, group, unit, column]
    units = units.permute(0, 2, 3, 4, 1, 5).reshape(blocks, supers, 16 * 192)
    return torch.cat([d, sc, units], dim=2).view(blocks, -1)


def check_q6k(fn: str, name: str, packed: torch.Tensor, n: int, k: int) -> None:
    """A weight in `pack_q6k`'s layout of n outputs and k inputs, or a ValueError naming what differs."""
    _check_kquant(fn, name, packed, n, k, "Q6_K", Q6K_SUPER)


Q3K_SUPER = 64 + 16 * 16 + 16 * 96  # bytes of 256 columns of a `pack_q3k` block
Q3K_FORMAT = (3, 16)  # the experts' format tuple (bits, group) of `pack_q3k`'s layout


def pack_q3k(q: torch.Tensor, d: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """uint8 `[ceil(N / 16), K / 256 * 1856]` from llama.cpp's Q3_K values w = d * sc * (q - 4): q `[N, K]` in [0, 7]
    (K a multiple of 256), fp32 `d` `[N, K / 256]`, int8 `sc` `[N, K / 16]` in [-32, 31] (the file's 6-bit scale less
    32). As `pack_q6k`'s, per 256 columns the 16 d and the 16 x 16 sc, then per 16 columns 96 bytes: a 64-byte unit
    whose byte 4j + i holds output j's columns i, 4 + i (3 bits each) and the low 2 bits of 8 + i, then 32 bytes of
    nibbles, column 12 + i and the third bit of 8 + i, for position p = 4j + i in byte 16h + k's low nibble where p =
    32h + k and its high nibble where p = 32h + 16 + k, so that each half of 8 outputs finds its nibbles in 16 bytes
    (q6k.c)."""
    blocks, supers, q, d, sc = _q6k_heads("pack_q3k", q, d, sc, 7, (-32, 31), "Q3_K")
    q = q.view(blocks, Q6K_BLOCK, supers, 16, 4, 4)  # [block, output j, super-block, group, r, column i]
    unit = q[..., 0, :] | (q[..., 1, :] << 3) | ((q[..., 2, :] & 3) << 6)
    nibble = q[..., 3, :] | ((q[..., 2, :] >> 2) << 3)
    unit, nibble = (t.permute(0, 2, 3, 1, 4).reshape(blocks, supers, 16, 64) for t in (unit, nibble))
    nibble = nibble.view(blocks, supers, 16, 2, 2, 16)  # [..., h, which nibble, k]
    nibbles = nibble[..., 0, :] | (nibble[..., 1, :] << 4)
    groups = torch.cat([unit, nibbles.reshape(blocks, supers, 16, 32)], dim=3).view(blocks, supers, 16 * 96)
    return torch.cat([d, sc, groups], dim=2).view(blocks, -1)


def check_q3k(fn: str, name: str, packed: torch.Tensor, n: int, k: int) -> None:
    """A weight in `pack_q3k`'s layout of n outputs and k inputs, or a ValueError naming what differs."""
    _check_kquant(fn, name, packed, n, k, "Q3_K", Q3K_SUPER)


def _check_kquant_values(fn: str, q: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor,
                         m: torch.Tensor, group: int) -> None:
    """The k-quants' values (w = d * sc * q - dmin * m, sc and m per `group` columns) as `fn` takes them, or a
    ValueError naming what it got."""
    n, k = q.shape
    if (q.dtype != torch.uint8 or k % 256
            or any(t.dtype != torch.float32 or t.shape != (n, k // 256) for t in (d, dmin))
            or any(t.dtype != torch.uint8 or t.shape != (n, k // group) for t in (sc, m))):
        given = ", ".join(f"{t.dtype} {tuple(t.shape)}" for t in (q, d, dmin, sc, m))
        raise ValueError(f"{fn} takes uint8 q [N, K] with K % 256 == 0, fp32 d and dmin [N, K / 256], uint8 sc "
                         f"and m [N, K / {group}], not {given}")


Q2K_SUPER = 128 + 16 * 16 + 16 * 64  # bytes of 256 columns of a `pack_q2k` block
Q2K_FORMAT = (2, 16)  # the experts' format tuple (bits, group) of `pack_q2k`'s layout


def pack_q2k(q: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """uint8 `[ceil(N / 16), K / 256 * 1408]` from llama.cpp's Q2_K values w = d * sc * q - dmin * m: q `[N, K]` in
    [0, 3] (K a multiple of 256), fp32 `d`, `dmin` `[N, K / 256]`, uint8 `sc`, `m` `[N, K / 16]` (4 bits). The outputs
    in blocks of 16 (zero rows pad the last), each block per 256 columns the 16 d, the 16 dmin, the 16 x 16 bytes sc |
    m << 4 (group-major), then per 16 columns a 64-byte unit whose byte 4j + i holds output j's column 4r + i in bits
    2r, 2r + 1 (q6k.c)."""
    n, k = q.shape
    _check_kquant_values("pack_q2k", q, d, dmin, sc, m, 16)
    for name, t, top in (("q", q, 3), ("sc", sc, 15), ("m", m, 15)):
        if t.numel() and int(t.max()) > top:
            raise ValueError(f"pack_q2k: {name} holds {int(t.max())}, past Q2_K's {top}")
    pad = -n % Q6K_BLOCK
    q, d, dmin, sc, m = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, d, dmin, sc, m))
    blocks, supers = (n + pad) // Q6K_BLOCK, k // 256
    q = q.view(blocks, Q6K_BLOCK, supers, 16, 4, 4)  # [block, output, super-block, group, r, column i]
    units = (q << (2 * torch.arange(4, dtype=torch.uint8)).view(4, 1)).sum(dim=4, dtype=torch.uint8)
    units = units.permute(0, 2, 3, 1, 4).reshape(blocks, supers, 16 * 64)  # [block, super-block, group, j, i]
    heads = [t.contiguous().view(blocks, Q6K_BLOCK, supers).transpose(1, 2).contiguous().view(torch.uint8)
             for t in (d, dmin)]
    subs = (sc | (m << 4)).view(blocks, Q6K_BLOCK, supers, 16).permute(0, 2, 3, 1).reshape(blocks, supers, 256)
    return torch.cat([*(h.view(blocks, supers, 64) for h in heads), subs, units], dim=2).view(blocks, -1)


def check_q2k(fn: str, name: str, packed: torch.Tensor, n: int, k: int) -> None:
    """A weight in `pack_q2k`'s layout of n outputs and k inputs, or a ValueError naming what differs."""
    _check_kquant(fn, name, packed, n, k, "Q2_K", Q2K_SUPER)


Q5_GROUP = 32 + 64 + 4 * 64  # bytes of 32 columns of a `pack_q50` or `pack_q5k` block
Q51_GROUP = 64 + 64 + 4 * 64  # of a `pack_q51` block
Q4_GROUP = 32 + 4 * 64  # of a `pack_q4k` block
Q5K_SUPER, Q4K_SUPER = 128 + 8 * Q5_GROUP, 128 + 8 * Q4_GROUP  # bytes of 256 columns of a `pack_q5k`, `pack_q4k` block
Q50_FORMAT, Q5K_FORMAT, Q4K_FORMAT = (5, 32), (5, 256), (4, 256)  # the experts' format tuples (bits, group)
Q51_FORMAT = (5, 32, 1)  # (bits, group, mins): mins tells `pack_q51`'s layout from `pack_q50`'s


def _q45_units(q: torch.Tensor, bits: int, fn: str) -> torch.Tensor:
    """uint8 `[blocks, K / 32, 320]` from q `[N, K]` in [0, 31] (N a multiple of 16): per block of 16 outputs and 32
    columns, 64 bytes whose byte 4j + i holds in bit 2c + h the fifth bit of output j's column 8c + 4h + i, then per 8
    columns c 64 bytes whose byte 4j + i holds the low 4 bits of output j's column 8c + i (low nibble) and 8c + 4 + i
    (high) (q45.c). `bits` 4: q in [0, 15], the nibbles alone (`[blocks, K / 32, 256]`)."""
    if q.numel() and int(q.max()) >> bits:
        raise ValueError(f"{fn}: q holds {int(q.max())}, past {bits} bits' {(1 << bits) - 1}")
    n, k = q.shape
    blocks, groups = n // Q50_BLOCK, k // 32
    q = q.view(blocks, Q50_BLOCK, groups, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)  # [block, group, c, h, j, i]
    nibbles = ((q[:, :, :, 0] & 15) | ((q[:, :, :, 1] & 15) << 4)).reshape(blocks, groups, 4 * 64)
    if bits == 4:
        return nibbles
    shifts = torch.arange(8, dtype=torch.uint8).view(4, 2, 1, 1)  # bit 2c + h
    fifth = (((q >> 4) & 1) << shifts).sum(dim=(2, 3), dtype=torch.uint8).reshape(blocks, groups, 64)
    return torch.cat([fifth, nibbles], dim=2)


def _by_block(t: torch.Tensor) -> torch.Tensor:
    """`[N, C]` (N a multiple of 16) as `[blocks, C, bytes]`: per block and column the 16 outputs' values' bytes."""
    n, c = t.shape
    return t.reshape(n // Q50_BLOCK, Q50_BLOCK, c).transpose(1, 2).contiguous().view(torch.uint8).reshape(
        n // Q50_BLOCK, c, -1)


def pack_q50(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """uint8 `[ceil(N / 16), K / 32 * 352]` from llama.cpp's Q5_0 values w = d * (q - 16): q `[N, K]` in [0, 31] (K
    a multiple of 64), fp16 `d` `[N, K / 32]`. The outputs in blocks of 16 (zero rows pad the last), each block per 32
    columns the 16 d, then `_q45_units`' bytes (q45.c)."""
    n, k = q.shape
    if q.dtype != torch.uint8 or k % 64 or d.dtype != torch.float16 or d.shape != (n, k // 32):
        raise ValueError(f"pack_q50 takes uint8 q [N, K] with K % 64 == 0 and fp16 d [N, K / 32], not {q.dtype} "
                         f"{tuple(q.shape)} and {d.dtype} {tuple(d.shape)}")
    pad = -n % Q50_BLOCK
    q, d = torch.nn.functional.pad(q, (0, 0, 0, pad)), torch.nn.functional.pad(d, (0, 0, 0, pad))
    units = _q45_units(q, 5, "pack_q50")
    return torch.cat([_by_block(d), units], dim=2).view(units.shape[0], -1)


def pack_q51(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """uint8 `[ceil(N / 16), K / 32 * 384]` from llama.cpp's Q5_1 values w = d * q + m: q `[N, K]` in [0, 31] (K a
    multiple of 64), fp16 `d`, `m` `[N, K / 32]`. `pack_q50`'s layout with each group's header the 16 d, then the 16
    m (q45.c)."""
    n, k = q.shape
    if (q.dtype != torch.uint8 or k % 64
            or any(t.dtype != torch.float16 or t.shape != (n, k // 32) for t in (d, m))):
        raise ValueError(f"pack_q51 takes uint8 q [N, K] with K % 64 == 0 and fp16 d and m [N, K / 32], not "
                         f"{q.dtype} {tuple(q.shape)}, {d.dtype} {tuple(d.shape)} and {m.dtype} {tuple(m.shape)}")
    pad = -n % Q50_BLOCK
    q, d, m = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, d, m))
    units = _q45_units(q, 5, "pack_q51")
    return torch.cat([_by_block(d), _by_block(m), units], dim=2).view(units.shape[0], -1)


def _pack_kquant(q: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, m: torch.Tensor, bits: int,
                 fn: str) -> torch.Tensor:
    """`pack_q5k` (bits 5) and `pack_q4k` (4)."""
    n, k = q.shape
    _check_kquant_values(fn, q, d, dmin, sc, m, 32)
    pad = -n % Q50_BLOCK
    q, d, dmin, sc, m = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, d, dmin, sc, m))
    groups = torch.cat([_by_block(sc), _by_block(m), _q45_units(q, bits, fn)], dim=2)  # [blocks, K / 32, group]
    blocks, supers = groups.shape[0], k // 256
    header = torch.cat([_by_block(d), _by_block(dmin)], dim=2)  # [blocks, supers, 128]
    return torch.cat([header, groups.reshape(blocks, supers, -1)], dim=2).view(blocks, -1)


def pack_q5k(q: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """uint8 `[ceil(N / 16), K / 256 * 2944]` from llama.cpp's Q5_K values w = d * sc * q - dmin * m: q `[N, K]` in
    [0, 31] (K a multiple of 256), fp32 `d`, `dmin` `[N, K / 256]`, uint8 `sc`, `m` `[N, K / 32]` (6 bits). The
    outputs in blocks of 16 (zero rows pad the last), each block per 256 columns the 16 d, the 16 dmin, then per 32
    columns the 16 sc, the 16 m and `_q45_units`' bytes (q45.c)."""
    return _pack_kquant(q, d, dmin, sc, m, 5, "pack_q5k")


def pack_q4k(q: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """uint8 `[ceil(N / 16), K / 256 * 2432]` from llama.cpp's Q4_K values: `pack_q5k`'s with q in [0, 15] and no fifth
    bits (q45.c)."""
    return _pack_kquant(q, d, dmin, sc, m, 4, "pack_q4k")


def _check_groups_of_32(fn: str, name: str, packed: torch.Tensor, n: int, k: int, kind: str, group_bytes: int) -> None:
    if k % 64:
        raise ValueError(f"{fn}: the {kind} kernel takes K a multiple of 64; got K {k}")
    tensor(fn, f"{name} ({kind} weight of {n} outputs, {k} inputs in pack_{kind.lower().replace('_', '')}'s layout)",
           packed, U8, (-(-n // Q50_BLOCK), k // 32 * group_bytes))


def check_q50(fn: str, name: str, packed: torch.Tensor, n: int, k: int) -> None:
    """A weight in `pack_q50`'s layout of n outputs and k inputs, or a ValueError naming what differs."""
    _check_groups_of_32(fn, name, packed, n, k, "Q5_0", Q5_GROUP)


def check_q51(fn: str, name: str, packed: torch.Tensor, n: int, k: int) -> None:
    """A weight in `pack_q51`'s layout of n outputs and k inputs, or a ValueError naming what differs."""
    _check_groups_of_32(fn, name, packed, n, k, "Q5_1", Q51_GROUP)


def _check_kquant(fn: str, name: str, packed: torch.Tensor, n: int, k: int, kind: str, super_bytes: int) -> None:
    if k % 256:
        raise ValueError(f"{fn}: the {kind} kernel takes K a multiple of 256; got K {k}")
    tensor(fn, f"{name} ({kind} weight of {n} outputs, {k} inputs in pack_{kind.lower().replace('_', '')}'s layout)",
           packed, U8, (-(-n // Q50_BLOCK), k // 256 * super_bytes))


def check_q5k(fn: str, name: str, packed: torch.Tensor, n: int, k: int) -> None:
    """A weight in `pack_q5k`'s layout of n outputs and k inputs, or a ValueError naming what differs."""
    _check_kquant(fn, name, packed, n, k, "Q5_K", Q5K_SUPER)


def check_q4k(fn: str, name: str, packed: torch.Tensor, n: int, k: int) -> None:
    """A weight in `pack_q4k`'s layout of n outputs and k inputs, or a ValueError naming what differs."""
    _check_kquant(fn, name, packed, n, k, "Q4_K", Q4K_SUPER)
