"""Run two ubatches on two threads in strict alternation, switching at `dbo_yield()`."""
from __future__ import annotations

import threading
from typing import Callable, Sequence, TypeVar

import torch

from latentserve.forward_context import set_dbo_yield_hook

T = TypeVar("T")


class UBatchError(RuntimeError):
    """A ubatch raised; the message names it and the original error is the cause."""

    def __init__(self, ubatch_id: int, error: BaseException):
        super().__init__(f"ubatch {ubatch_id} failed: {type(error).__name__}: {error}")
        self.ubatch_id = ubatch_id


class _Aborted(Exception):
    """Raised inside a ubatch to unwind it after the other ubatch failed."""


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


def run_ubatches(tasks: Sequence[Callable[[], T]]) -> list[T]:
    """Run each task on its own thread, one at a time, switching at every `dbo_yield()`.

    Task 0 starts; a yield hands control to the next unfinished task. If a task raises, the
    others are unwound at their next yield and `UBatchError` names the first failure.
    """
    baton = _Baton(len(tasks))
    grad_enabled = torch.is_grad_enabled()  # grad mode is per thread: carry the caller's over
    results: list[T | None] = [None] * len(tasks)
    errors: list[BaseException | None] = [None] * len(tasks)

    def yield_hook(i: int) -> Callable[[], None]:
        def hook() -> None:
            baton.pass_turn(i)
            baton.wait_turn(i)

        return hook

    def body(i: int) -> None:
        set_dbo_yield_hook(yield_hook(i))
        failed = False
        try:
            baton.wait_turn(i)
            with torch.set_grad_enabled(grad_enabled):
                results[i] = tasks[i]()
        except _Aborted:
            pass
        except BaseException as e:  # noqa: BLE001 - reported to the caller below
            errors[i] = e
            failed = True
        finally:
            set_dbo_yield_hook(None)
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
