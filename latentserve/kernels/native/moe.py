"""MoE's wrappers: routing, the experts in every weight format (their table, checked here) and a decode step's whole MoE
block."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from latentserve.kernels import abi
from latentserve.kernels.abi import ExpertTable, MoEBlock, desc
from latentserve.kernels.build import NativeKernels
from latentserve.kernels.checks import tensor
from latentserve.kernels.native.calls import F32, I64, KERNEL_DTYPES, block_dtype, call, refused
from latentserve.kernels.native.packing import (Q2K_FORMAT, Q3K_FORMAT, Q4K_FORMAT, Q5K_FORMAT, Q6K_FORMAT,
                                                Q50_FORMAT, Q51_FORMAT, check_int4, check_int8, check_q2k, check_q3k,
                                                check_q4k, check_q5k, check_q6k, check_q50, check_q51)


def route(kernels: NativeKernels, logits: torch.Tensor, k: int, sigmoid: bool, groups: int, topk_groups: int,
          bias: torch.Tensor | None, norm: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights `[T, k]` fp32, expert ids `[T, k]` int64) from fp32 router logits `[T, E]`: softmax or sigmoid scores
    (+ bias `[E]` to choose, not to weigh), the best `topk_groups` of `groups` equal groups kept (softmax: a group's
    best score; sigmoid: its best two), the top k, weights divided by their sum (`norm`) and scaled."""
    logits = logits.contiguous()
    bias = bias.contiguous() if bias is not None else None
    tokens, experts = tensor("route", "logits", logits, F32, (None, None))
    # sigmoid scores a group by its best two experts: a limit on groups of one would score every group -inf
    if (not 0 < topk_groups <= groups or experts % groups or not 0 < k <= topk_groups * (experts // groups)
            or (sigmoid and topk_groups < groups and experts // groups < 2)
            or (bias is not None and bias.shape != (experts,))):
        raise ValueError(f"route: {k} of {experts} experts from the best {topk_groups} of {groups} groups cannot be "
                         f"chosen (sigmoid {sigmoid}: at least 2 experts a group; bias "
                         f"{None if bias is None else tuple(bias.shape)})")
    if bias is not None:
        tensor("route", "bias", bias, F32, (experts,))
    weights, ids = torch.empty(tokens, k), torch.empty(tokens, k, dtype=torch.int64)
    refused(kernels, "route", call(kernels, "ls_route", desc(logits), int(sigmoid), groups, topk_groups,
                                   None if bias is None else desc(bias), int(norm), scaling, desc(weights),
                                   desc(ids)))
    return weights, ids


# A weight's format as the experts read it: (32, 0) fp32 rows, (16, 0) bf16 rows, (8, 0) `pack_int8`'s layout, (4, group
# size) `pack_int4`'s, (6, 16) `pack_q6k`'s, (3, 16) `pack_q3k`'s, (2, 16) `pack_q2k`'s, (5, 32) `pack_q50`'s, (5, 32,
# 1) `pack_q51`'s, (5, 256) `pack_q5k`'s, (4, 256) `pack_q4k`'s (int4's groups are at most 128): (bits, group[, mins]),
# mins 0 where left out.
Format = tuple[int, ...]
# The GGUF block formats and what checks a weight of each (`packing.py`).
FILE_FORMATS = {Q6K_FORMAT: check_q6k, Q50_FORMAT: check_q50, Q51_FORMAT: check_q51, Q5K_FORMAT: check_q5k,
                Q4K_FORMAT: check_q4k, Q2K_FORMAT: check_q2k, Q3K_FORMAT: check_q3k}
DENSE_FORMATS = {torch.float32: (32, 0), torch.bfloat16: (16, 0)}


@dataclass
class Experts:
    """A set of experts as `experts` reads them: the table, their hidden size and what the table points into."""

    table: ExpertTable
    hidden: int
    held: list


def expert_table(weights: list[tuple[torch.Tensor, torch.Tensor]], hidden: int, inter: int,
                 formats: tuple[Format, Format]) -> Experts:
    """The experts whose (gate_up, down) are `weights`: gate_up `[2 * inter, hidden]` (gate's rows, then up's) and
    down `[hidden, inter]`, each projection of every expert in its one format (`formats`: gate_up's, down's; dense
    ones as `[N, K]` contiguous rows of the format's dtype, quantized ones packed), each checked here."""
    fn = "expert_table"
    if not weights or any(f not in (*DENSE_FORMATS.values(), (8, 0), *FILE_FORMATS)
                          and not (len(f) == 2 and f[0] == 4) for f in formats):
        raise ValueError(f"{fn} takes at least one expert in formats (32, 0), (16, 0), (8, 0), (4, group size), "
                         f"{', '.join(map(str, FILE_FORMATS))}; got {len(weights)} experts, formats {formats}")
    dense = {f: (d,) for d, f in DENSE_FORMATS.items()}
    for e, pair in enumerate(weights):
        for which, (w, fmt) in enumerate(zip(pair, formats)):
            n, k = (2 * inter, hidden) if which == 0 else (hidden, inter)
            name = f"experts[{e}].{('gate_up', 'down')[which]}"
            if fmt in dense:
                tensor(fn, name, w, dense[fmt], (n, k))
            else:
                _check_packed(fn, name, w, n, k, fmt)
    pointers = (ctypes.c_void_p * (2 * len(weights)))(*(w.data_ptr() for pair in weights for w in pair))
    table = ExpertTable(len(weights), inter, (ctypes.c_int32 * 2)(*(f[0] for f in formats)),
                        (ctypes.c_int32 * 2)(*(f[2] if len(f) > 2 else 0 for f in formats)),
                        (ctypes.c_int64 * 2)(*(f[1] for f in formats)), ctypes.addressof(pointers))
    return Experts(table, hidden, [pointers, *(w for pair in weights for w in pair)])


def experts(kernels: NativeKernels, x: torch.Tensor, routed: Experts, ids: torch.Tensor, weights: torch.Tensor,
            shared: Experts | None = None) -> torch.Tensor:
    """`[T, K]` in x's dtype (fp32 or bf16): each token of x `[T, K]` (contiguous) through its routed experts ids
    `[T, k]` (int64, rows of `routed`) in increasing id order, summed in fp32 with `weights` `[T, k]` (fp32), rounded
    to x's dtype; plus, rounded too, the `shared` experts' output (one expert), as torch adds the two. Each token's
    result is what it would be alone."""
    fn = "experts"
    tokens = tensor(fn, "x", x, KERNEL_DTYPES, (None, routed.hidden))[0]
    ids, weights = ids.contiguous(), weights.contiguous()  # held here: a temporary's memory goes with its last use
    k = tensor(fn, "ids", ids, I64, (tokens, None))[1]
    tensor(fn, "weights", weights, F32, (tokens, k))
    if shared is not None and (shared.table.experts != 1 or shared.hidden != routed.hidden):
        raise ValueError(f"{fn}: the shared experts must be one expert of hidden size {routed.hidden}; got "
                         f"{shared.table.experts} of {shared.hidden}")
    y = torch.empty(tokens, routed.hidden, dtype=x.dtype)
    code = call(kernels, "ls_experts", ctypes.byref(routed.table), None if shared is None else ctypes.byref(
        shared.table), desc(x), desc(ids), desc(weights), desc(y), torch.get_num_threads())
    if code == abi.BAD_EXPERT:
        raise ValueError(f"{fn}: the table holds experts 0..{routed.table.experts - 1}, got ids {ids.tolist()}")
    refused(kernels, fn, code)
    return y


def _check_packed(fn: str, name: str, packed: torch.Tensor, n: int, k: int, fmt: Format) -> None:
    if fmt[0] == 8:
        check_int8(fn, name, packed, n, k)
    elif fmt in FILE_FORMATS:
        FILE_FORMATS[fmt](fn, name, packed, n, k)
    else:
        check_int4(fn, name, packed, n, k, fmt[1])


def moe_block(kernels: NativeKernels, block: MoEBlock, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + moe(x) for a few tokens x `[T, hidden]` and the residual stream (both contiguous, the block's
    dtype)."""
    dtype = (block_dtype(block),)
    tokens = tensor("moe_block", "x", x, dtype, (None, block.hidden))[0]
    tensor("moe_block", "residual", residual, dtype, (tokens, block.hidden))
    y = torch.empty_like(residual)
    code = call(kernels, "ls_moe_block", ctypes.byref(block), desc(x), desc(residual), desc(y),
                torch.get_num_threads())
    if code == abi.BAD_EXPERT:
        raise ValueError(f"moe_block: the routing chose an expert outside the {block.experts} the block holds")
    refused(kernels, "moe_block", code)
    return y
