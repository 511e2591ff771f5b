"""latentserve.h in ctypes: the tensor descriptor, the block structs, the enums and status codes, and every `ls_`
function's signature in one table. `declare` gives a loaded library its signatures and refuses it where its struct
layout (`ls_struct_layout`) differs from the structs here: a library and a mirror that disagree would read each
other's fields at the wrong offsets."""
from __future__ import annotations

import ctypes
import struct

import torch

MAX_DIMS, MAX_ROPE, MAX_LATENT = 5, 1024, 2048  # LS_MAX_DIMS, LS_MAX_ROPE, LS_MAX_LATENT
MAX_POSITIONS = 1 << 40  # LS_MAX_POSITIONS: prefill attention's distance and window
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2, torch.int8: 3, torch.uint8: 4,
          torch.int32: 5, torch.int64: 6}  # ls_dtype
DENSE, INT8, INT4, INT8_LANES, INT8_BLOCKS, Q6K, Q50, Q5K, Q4K, Q51, Q2K, Q3K = range(12)  # ls_weight_kind
ROPE_STYLES = ("gptj", "interleave", "neox")  # ls_rope_style's order: DeepSeek's rope layouts (layers/rotary.py)
# ls_status
(OK, BAD_QUERY_START, NEGATIVE_SEQ_LEN, SEQ_PAST_TABLE, BLOCK_PAST_CACHE, SLOT_PAST_CACHE, BAD_EXPERT, BAD_TENSOR,
 NO_MEMORY, BAD_BLOCK, NO_AMX) = range(11)


class Tensor(ctypes.Structure):
    """ls_tensor: data, ls_dtype, rank, shape and strides (elements). `desc` packs the same bytes faster."""

    _fields_ = [("data", ctypes.c_void_p), ("dtype", ctypes.c_int32), ("ndim", ctypes.c_int32),
                ("shape", ctypes.c_int64 * MAX_DIMS), ("strides", ctypes.c_int64 * MAX_DIMS)]


# One packer per rank: the unused sizes and strides zero. struct.pack is ~3x faster than filling a ctypes.Structure
# (the wrappers run per layer per decode step); bytes pass to C as a pointer to themselves, with no copy.
_PACKERS = tuple(struct.Struct(f"<Qii{n}q{8 * (MAX_DIMS - n)}x{n}q{8 * (MAX_DIMS - n)}x")
                 for n in range(MAX_DIMS + 1))


def desc(t: torch.Tensor) -> bytes:
    """t's ls_tensor (t checked by the caller: a CPU tensor of a dtype in DTYPES, at most MAX_DIMS dims)."""
    n = t.dim()
    return _PACKERS[n].pack(t.data_ptr(), DTYPES[t.dtype], n, *t.shape, *t.stride())


class Weight(ctypes.Structure):
    """One projection's weight (ls_weight_kind): DENSE (w in the activations' dtype, `[N, K]`, per-head products
    bmm's `[H, K, N]`), INT8 (per-head products' w `[H, N, K]`, per-row fp32 scale and int32 sum), INT8_LANES (the
    same in `int8_lanes`' layout), INT8_BLOCKS (w in `pack_int8`'s layout), INT4 (w in `pack_int4`'s layout, group
    size), Q6K (w in `pack_q6k`'s layout, group 16), Q50 (`pack_q50`'s, group 32), Q5K (`pack_q5k`'s, group 256),
    Q4K (`pack_q4k`'s, group 256), Q51 (`pack_q51`'s, group 32), Q2K (`pack_q2k`'s, group 16) or Q3K (`pack_q3k`'s,
    group 16)."""

    _fields_ = [("kind", ctypes.c_int32), ("w", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("qsum", ctypes.c_void_p), ("group", ctypes.c_int64)]


class MLABlock(ctypes.Structure):
    """One layer's attention as attention_block.c reads it: shapes (with no q_lora, q_b is q_proj), weights, norm
    weight addresses (contiguous, the activations' dtype; post_norm is the MLP's input norm) and epsilons, the
    softmax scale, the rope style (`ROPE_STYLES` index), whether activations are bf16."""

    _fields_ = [(name, ctypes.c_int64) for name in ("hidden", "heads", "nope", "rope", "latent", "v_dim", "q_lora")] + [
        (name, Weight) for name in ("q_a", "q_b", "kv_a", "o_proj", "uk", "uv")] + [
        (name, ctypes.c_void_p) for name in ("input_norm", "q_a_norm", "kv_a_norm", "post_norm")] + [
        (name, ctypes.c_float) for name in ("eps", "q_a_eps", "kv_a_eps", "post_eps", "scale")] + [
        ("style", ctypes.c_int32), ("bf", ctypes.c_int32)]


class ExpertTable(ctypes.Structure):
    """A set of experts of one shape and one format per projection (experts.c): how many, their intermediate size,
    gate_up's and down's format (bits: 32 fp32 rows, 16 bf16 rows, 8 `pack_int8`'s layout, 4 `pack_int4`'s, 6
    `pack_q6k`'s, 5 `pack_q50`'s, `pack_q51`'s or `pack_q5k`'s, 4 with group 256 `pack_q4k`'s; mins 1 for `pack_q51`'s,
    else 0; int4's group size, Q6_K's 16, Q5_0's and Q5_1's 32, the k-quants' 256) and the address of a table of two
    weight addresses per expert (gate_up `[2 * inter, hidden]`, down `[hidden, inter]`)."""

    _fields_ = [("experts", ctypes.c_int64), ("inter", ctypes.c_int64), ("bits", ctypes.c_int32 * 2),
                ("mins", ctypes.c_int32 * 2), ("group", ctypes.c_int64 * 2), ("weights", ctypes.c_void_p)]


class MoEBlock(ctypes.Structure):
    """One layer's MoE as moe_block.c reads it: shapes and routing (`ls_route`'s arguments), the fp32 router weight
    `[experts, hidden]` and correction bias (or None), whether activations are bf16, then the routed experts and the
    shared ones as one expert of their whole width (`shared.experts` 0: none)."""

    _fields_ = [(name, ctypes.c_int64) for name in ("hidden", "experts", "topk", "groups", "topk_groups")] + [
        ("sigmoid", ctypes.c_int32), ("norm", ctypes.c_int32), ("scaling", ctypes.c_float),
        ("router", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("bf", ctypes.c_int32),
        ("routed", ExpertTable), ("shared", ExpertTable)]


class Field(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("offset", ctypes.c_int64), ("size", ctypes.c_int64)]


STRUCTS = {"ls_tensor": Tensor, "Weight": Weight, "MLABlock": MLABlock, "ExpertTable": ExpertTable,
           "MoEBlock": MoEBlock}

_i32, _i64, _f32, _status = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_int32
_T = ctypes.c_char_p  # a const ls_tensor *: `desc`'s bytes, or None
SIGNATURES = {  # name: (restype, argtypes), as latentserve.h declares them
    "ls_struct_layout": (ctypes.POINTER(Field), []),
    "ls_set_scratch_limit": (None, [_i64]),
    "ls_set_read_ahead": (None, [_i64]),
    "ls_last_error": (ctypes.c_char_p, []),
    "ls_enable_amx": (_status, []),
    "ls_dense_linear": (_status, [_T, _T, _T, _i32]),
    "ls_dense_heads": (_status, [_T, _T, _T, _i32]),
    "ls_int8_heads": (_status, [_T, _T, _T, _T, _T, _i32]),
    "ls_int8_heads_lanes": (_status, [_T, _T, _T, _T, _T, _i32]),
    "ls_int8_linear": (_status, [_T, _T, _T, _i32]),
    "ls_int4_linear": (_status, [_T, _T, _i64, _T, _i32]),
    "ls_q6k_linear": (_status, [_T, _T, _T, _i32]),
    "ls_q2k_linear": (_status, [_T, _T, _T, _i32]),
    "ls_q3k_linear": (_status, [_T, _T, _T, _i32]),
    "ls_q50_linear": (_status, [_T, _T, _T, _i32]),
    "ls_q51_linear": (_status, [_T, _T, _T, _i32]),
    "ls_q5k_linear": (_status, [_T, _T, _T, _i32]),
    "ls_q4k_linear": (_status, [_T, _T, _T, _i32]),
    "ls_rms_norm": (_status, [_T, _T, _f32, _T, _i32]),
    "ls_argmax": (_status, [_T, _T, _i32]),
    "ls_mla_prologue": (_status, [_T, _T, _T, _f32, _T, _T, _i32, _T, _T, _T, _T, _i32]),
    "ls_mla_decode": (_status, [_T, _T, _T, _T, _T, _f32, _T, _i32]),
    "ls_prefill_attention": (_status, [_T, _T, _T, _i32, _i64, _i64, _f32, _T, _T, _i32]),
    "ls_route": (_status, [_T, _i32, _i64, _i64, _T, _i32, _f32, _T, _T]),
    "ls_mla_attention_block": (_status, [ctypes.POINTER(MLABlock), _T, _T, _T, _T, _T, _T, _T, _T, _T, _T, _i32]),
    "ls_moe_block": (_status, [ctypes.POINTER(MoEBlock), _T, _T, _T, _i32]),
    "ls_decode_layers": (_status, [ctypes.POINTER(ctypes.POINTER(MLABlock)), ctypes.POINTER(ctypes.POINTER(MoEBlock)),
                                   _T, _i64, _T, _T, _T, _T, _T, _T, _T, _T, _f32, _T, _i32]),
    "ls_experts": (_status, [ctypes.POINTER(ExpertTable), ctypes.POINTER(ExpertTable), _T, _T, _T, _T, _i32]),
}


class LayoutMismatch(Exception):
    """The library's struct layout differs from the ctypes mirror here."""


def layout_mismatch(lib: ctypes.CDLL, structs: dict[str, type[ctypes.Structure]] = STRUCTS) -> str | None:
    """What differs between the library's `ls_struct_layout` and `structs` (a struct's size, a field's offset or
    size, a field only one side has), or None."""
    theirs, table = {}, lib.ls_struct_layout()
    for i in range(10_000):  # the table ends with a NULL name
        if table[i].name is None:
            break
        theirs[table[i].name.decode()] = (table[i].offset, table[i].size)
    ours = {}
    for name, mirror in structs.items():
        ours[name] = (0, ctypes.sizeof(mirror))
        for field, _ in mirror._fields_:
            described = getattr(mirror, field)
            ours[f"{name}.{field}"] = (described.offset, described.size)
    for key in sorted(ours.keys() | theirs.keys()):
        if ours.get(key) != theirs.get(key):
            return (f"struct {key.split('.')[0]}: {key} is (offset, size) {theirs.get(key)} in the library, "
                    f"{ours.get(key)} in kernels/abi.py")
    return None


def declare(lib: ctypes.CDLL) -> None:
    """`lib` given SIGNATURES; an AttributeError where it lacks a function (a stale or partial build), a
    LayoutMismatch where its structs are laid out differently."""
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    why = layout_mismatch(lib)
    if why is not None:
        raise LayoutMismatch(why)
