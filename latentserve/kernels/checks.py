"""The kernels' boundary rule: nothing reaches C as an address before its tensor is checked. Every wrapper in
native/ checks each tensor it passes (a CPU tensor, a dtype the kernel reads, contiguous, the shape the kernel
assumes) with `tensor`, and each index the kernel follows into another tensor (block ids, cache slots, query starts)
with bounds.c's loops; what fails is a ValueError naming the wrapper, the argument and what was expected, never an
out-of-bounds access. The checks cost well under a microsecond a tensor: the wrappers run per layer per decode step."""
from __future__ import annotations

import torch

Shape = tuple[int | None, ...]  # None: any size along that dimension


def tensor(fn: str, name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...], shape: Shape | None = None,
           numel: int | None = None, contiguous: bool = True) -> torch.Size:
    """t's shape where t is a CPU tensor of one of `dtypes`, contiguous (unless not asked), of `shape` (where given)
    and `numel` elements (where given); else a ValueError saying what `fn` expected of `name`. Written for speed (a
    microsecond a call): is_cpu, not device.type."""
    try:
        actual = t.shape
        ok = t.is_cpu and t.dtype in dtypes and (not contiguous or t.is_contiguous())
    except AttributeError:  # not a tensor
        ok = False
    if ok and numel is not None:
        ok = t.numel() == numel
    if ok and shape is not None:
        ok = len(actual) == len(shape)
        for i, s in enumerate(shape if ok else ()):  # indexing a torch.Size is cheap, iterating one is not
            if s is not None and actual[i] != s:
                ok = False
    if not ok:
        raise ValueError(_describe(fn, name, t, dtypes, shape, numel, contiguous))
    return actual


def _describe(fn: str, name: str, t, dtypes: tuple[torch.dtype, ...], shape: Shape | None, numel: int | None,
              contiguous: bool) -> str:
    want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
    if contiguous:
        want = "contiguous " + want
    if shape is not None:
        want += " [" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    if numel is not None:
        want += f" of {numel} elements"
    if not isinstance(t, torch.Tensor):
        return f"{fn}: {name} must be a CPU tensor, {want}; got {type(t).__name__}"
    got = (f"{t.device.type} {str(t.dtype).removeprefix('torch.')} {list(t.shape)}"
           f"{'' if t.is_contiguous() else ' non-contiguous (strides ' + str(t.stride()) + ')'}")
    return f"{fn}: {name} must be a CPU tensor, {want}; got {got}"

