"""Run two ubatches on two threads in strict alternation, switching at `dbo_yield()`.

DBO's first invariant: within every layer, each ubatch calls `dbo_yield()` the same number of times. The
runner hands control over at each yield, so an extra yield in one ubatch shifts the interleaving of every
later layer: ubatch 1 can then run a layer's attention before ubatch 0 wrote that layer's KV, and the tail
of a split request reads its head's KV unwritten. In debug mode the runner counts yields per layer and
raises `UnequalYieldsError` where they first differ.
"""
from __future__ import annotations

import threading
from typing import Callable, Sequence, TypeVar

import torch

from latentserve.forward_context import set_dbo_yield_hook

T = TypeVar("T")


class UBatchError(RuntimeError):
    """A ubatch raised; the message names it and the original error is the cause."""

    def __init__(self, ubatch_id: int, error: BaseException | str):
        detail = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        super().__init__(f"ubatch {ubatch_id} failed: {detail}")
        self.ubatch_id = ubatch_id
        self.detail = detail

    def __reduce__(self):
        # Sent from a rank to the front end: the original error travels as text (it may not pickle).
        return type(self), (self.ubatch_id, self.detail)


class UnequalYieldsError(RuntimeError):
    """Two ubatches yielded a different number of times within one layer (see the module docstring)."""


class _Aborted(Exception):
    """Raised inside a ubatch to unwind it after the other ubatch failed."""


class _YieldCounts:
    """Yields of each ubatch in each layer, compared across ubatches as each one leaves a layer.

    Only the ubatch holding the turn touches it, so it needs no lock of its own.
    """

    def __init__(self, num: int):
        self.finished: list[list[tuple[str, int]]] = [[] for _ in range(num)]  # (where, yields) per left layer
        self.where = ["before the first layer"] * num
        self.yields = [0] * num

    def count_yield(self, i: int) -> None:
        self.yields[i] += 1

    def leave_layer(self, i: int, next_layer: str) -> None:
        k = len(self.finished[i])
        self.finished[i].append((self.where[i], self.yields[i]))
        self.where[i], self.yields[i] = f"in {next_layer}", 0
        for j, finished in enumerate(self.finished):
            if j != i and len(finished) > k and finished[k] != self.finished[i][k]:
                (where_j, yields_j), (where_i, yields_i) = finished[k], self.finished[i][k]
                raise UnequalYieldsError(
                    f"ubatch {i} yielded {yields_i} times {where_i} but ubatch {j} yielded {yields_j} times {where_j}: "
                    "every ubatch must call dbo_yield() equally often in each layer"
                )


_local = threading.local()


def enter_layer(name: str) -> None:
    """Mark that this ubatch starts layer `name` (what the yield check compares by); a no-op outside it, and for
    the layer it is already in (a layer may look its metadata up more than once)."""
    counts = getattr(_local, "counts", None)
    if counts is not None and counts.where[_local.ubatch_id] != f"in {name}":
        counts.leave_layer(_local.ubatch_id, name)


class _Baton:
    """Whose turn it is; exactly one ubatch thread runs at a time."""

    def __init__(self, num: int):
        self.cond = threading.Condition()
        self.turn = 0
        self.done = [False] * num
        self.failed = False

    def wait_turn(self, i: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.turn == i or self.failed)
            if self.failed:
                raise _Aborted

    def pass_turn(self, i: int) -> None:
        """Hand control to the next unfinished ubatch (or keep it if all others are done)."""
        with self.cond:
            n = len(self.done)
            for step in range(1, n + 1):
                j = (i + step) % n
                if not self.done[j]:
                    self.turn = j
                    break
            self.cond.notify_all()

    def finish(self, i: int, failed: bool) -> None:
        with self.cond:
            self.done[i] = True
            self.failed = self.failed or failed
        self.pass_turn(i)


def run_ubatches(tasks: Sequence[Callable[[], T]], check_yields: bool = False) -> list[T]:
    """Run each task on its own thread, one at a time, switching at every `dbo_yield()`.

    Task 0 starts; a yield hands control to the next unfinished task. If a task raises, the others are
    unwound at their next yield and `UBatchError` names the first failure. With `check_yields`, tasks
    that call `enter_layer()` must yield equally often per layer (and all of them equally often in total).
    """
    baton = _Baton(len(tasks))
    counts = _YieldCounts(len(tasks)) if check_yields else None
    grad_enabled = torch.is_grad_enabled()  # grad mode is per thread: carry the caller's over
    results: list[T | None] = [None] * len(tasks)
    errors: list[BaseException | None] = [None] * len(tasks)

    def yield_hook(i: int) -> Callable[[], None]:
        def hook() -> None:
            if counts is not None:
                counts.count_yield(i)
            baton.pass_turn(i)
            baton.wait_turn(i)

        return hook

    def body(i: int) -> None:
        set_dbo_yield_hook(yield_hook(i))
        _local.counts, _local.ubatch_id = counts, i
        failed = False
        try:
            baton.wait_turn(i)
            with torch.set_grad_enabled(grad_enabled):
                results[i] = tasks[i]()
            if counts is not None:
                counts.leave_layer(i, "")  # the last layer ends with the forward
        except _Aborted:
            pass
        except BaseException as e:  # noqa: BLE001 - reported to the caller below
            errors[i] = e
            failed = True
        finally:
            set_dbo_yield_hook(None)
            _local.counts = None
            baton.finish(i, failed)

    threads = [threading.Thread(target=body, args=(i,), name=f"ubatch-{i}", daemon=True) for i in range(len(tasks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, e in enumerate(errors):
        if e is not None:
            raise UBatchError(i, e) from e
    return results  # type: ignore[return-value]
