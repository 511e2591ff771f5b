"""Where an engine step's time goes: torch.profiler ops sorted into weight GEMMs, attention, MoE and the rest.

Profiling only: attention backends and MoE layers are wrapped in named profiler ranges for the run,
then unwrapped; the hot path carries nothing. A top-level op (one not called by another op) counts
as a GEMM when it or an op it calls is a matrix product. Inside an attention backend everything is
"attention"; inside an MoE layer the non-GEMM ops are "MoE routing + dispatch" (gate top-k, sort,
gather, scatter, activation); elsewhere they are "other ops" (norms, rotary, cache writes, sampling).
"Python + framework" is the rest of the step (under the profiler, so it includes the profiler's own
cost per op, about a microsecond). latentserve's own quantized kernels (ctypes calls) record a range of their name
while the profiler runs, and count as weight GEMMs (a batch-1 MoE call includes its experts' SiLU; the one-call
decode attention block includes its attention, a few percent of it at moderate contexts; the one-call decode MoE
block includes its routing, a fraction of a percent; the decode run of whole layers includes both).
"""
from __future__ import annotations

import bisect
import contextlib
import functools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from latentserve.layers.moe import MoE
from latentserve.kernels.native import PROFILE_PREFIX

ATTENTION, MOE, STEP = "latentserve/attention", "latentserve/moe", "latentserve/step:"
CATEGORIES = ("weight GEMMs", "attention", "MoE routing + dispatch", "other ops", "Python + framework")
GEMM_OPS = frozenset({
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::_grouped_mm",
    "aten::_weight_int4pack_mm", "aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm", "aten::_int_mm",
    "aten::_scaled_mm", "aten::mkldnn_linear",
})


def _scoped(fn: Callable, name: str) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def instrumented(engine) -> Iterator[None]:
    """Wrap the attention backends and MoE layers of `engine` in profiler ranges, for the duration only."""
    runner = engine.runner
    targets = []  # (object, attribute name, range name)
    for layer in engine.model.static_forward_context.values():
        targets.append((layer.decode_backend, "forward", ATTENTION))
    for builder in runner.builders:
        for backend in builder.prefill_backends.values():
            for method in ("run_prefill_new_tokens", "run_prefill_context_chunk"):
                targets.append((backend, method, ATTENTION))
    targets += [(m, "forward", MOE) for m in engine.model.modules() if isinstance(m, MoE)]
    targets = list({(id(obj), attr): (obj, attr, name) for obj, attr, name in targets}.values())
    for obj, attr, name in targets:
        setattr(obj, attr, _scoped(getattr(obj, attr), name))
    try:
        yield
    finally:
        for obj, attr, _ in targets:
            delattr(obj, attr)  # the class's method shows through again


def step_range(kind: str):
    """The profiler range around one step of `kind` ("decode" or "prefill")."""
    return record_function(STEP + kind)


def new_profiler() -> profile:
    try:  # ubatch threads (DBO) run ops too; an older torch records only the starting thread
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
        return profile(activities=[ProfilerActivity.CPU], experimental_config=config)
    except TypeError:
        return profile(activities=[ProfilerActivity.CPU])


@dataclass
class StepBreakdown:
    """Seconds per category, and of the steps themselves, summed over `num_steps` steps of one kind."""

    num_steps: int = 0
    wall_seconds: float = 0.0
    op_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))


def _is_native(event) -> bool:
    """A call of latentserve's own kernels (a range of its name: ctypes calls are no torch ops)."""
    return event.is_user_annotation and event.name.startswith(PROFILE_PREFIX)


def _has_gemm(event) -> bool:
    return event.name in GEMM_OPS or _is_native(event) or any(_has_gemm(c) for c in event.cpu_children)


def _scope(event) -> str | None:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in (ATTENTION, MOE):
            return parent.name
        parent = parent.cpu_parent
    return None


def _is_top_level_op(event) -> bool:
    if event.is_user_annotation and not _is_native(event):
        return False
    parent = event.cpu_parent
    while parent is not None:
        if not parent.is_user_annotation:
            return False
        parent = parent.cpu_parent
    return True


def categorize(events) -> dict[str, StepBreakdown]:
    """Op time per category for each step kind, from the events of a profile with `step_range`s."""
    steps = sorted((e.time_range.start, e.time_range.end, e.name[len(STEP):])
                   for e in events if e.is_user_annotation and e.name.startswith(STEP))
    starts = [s[0] for s in steps]
    result: dict[str, StepBreakdown] = defaultdict(StepBreakdown)
    for start, end, kind in steps:
        result[kind].num_steps += 1
        result[kind].wall_seconds += (end - start) * 1e-6
    for e in events:
        if not _is_top_level_op(e):
            continue
        # By time, not by parent: ops of ubatch threads have no parent on the stepping thread.
        i = bisect.bisect_right(starts, e.time_range.start) - 1
        if i < 0 or e.time_range.start > steps[i][1]:
            continue
        scope = _scope(e)
        if scope == ATTENTION:
            category = "attention"
        elif _has_gemm(e):
            category = "weight GEMMs"
        elif scope == MOE:
            category = "MoE routing + dispatch"
        else:
            category = "other ops"
        result[steps[i][2]].op_seconds[category] += e.cpu_time_total * 1e-6
    return dict(result)


def seconds_per_step(b: StepBreakdown) -> dict[str, float]:
    """Every category's seconds in one step (the mean over the profiled steps)."""
    per_step = {c: b.op_seconds.get(c, 0.0) / b.num_steps for c in CATEGORIES[:-1]}
    per_step[CATEGORIES[-1]] = max(0.0, (b.wall_seconds - sum(b.op_seconds.values())) / b.num_steps)
    return per_step


def format_breakdown(breakdowns: dict[str, StepBreakdown], unprofiled: dict[str, float]) -> str:
    """A table per step kind: ms per step and share; `unprofiled` holds the median step times without profiler."""
    lines = []
    for kind, b in sorted(breakdowns.items()):
        if not b.num_steps:
            continue
        step = b.wall_seconds / b.num_steps
        per_step = seconds_per_step(b)
        plain = f", {unprofiled[kind] * 1e3:.2f} ms without it" if kind in unprofiled else ""
        lines.append(f"{kind} steps ({b.num_steps} profiled: {step * 1e3:.2f} ms each under the profiler{plain})")
        width = max(len(c) for c in CATEGORIES)
        for c in CATEGORIES:
            lines.append(f"  {c:<{width}}  {per_step[c] * 1e3:8.2f} ms  {per_step[c] / step:6.1%}")
    return "\n".join(lines) + "\n"
