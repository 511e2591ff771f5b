import threading
import time

import pytest

from latentserve.forward_context import dbo_yield
from latentserve.ubatch.runner import UBatchError, run_ubatches


def _ubatch_threads():
    return [t for t in threading.enumerate() if t.name.startswith("ubatch-")]


def test_strict_alternation_at_yields():
    log = []

    def task(name, steps):
        def run():
            for i in range(steps):
                log.append((name, i))
                dbo_yield()
            return name

        return run

    assert run_ubatches([task("a", 3), task("b", 5)]) == ["a", "b"]
    assert log == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2), ("b", 3), ("b", 4)]
    assert not _ubatch_threads()


def test_only_one_ubatch_runs_at_a_time():
    running = []
    overlap = []

    def task():
        for _ in range(20):
            running.append(1)
            if len(running) > 1:
                overlap.append(True)
            time.sleep(0.001)
            running.pop()
            dbo_yield()

    run_ubatches([task, task])
    assert not overlap


def test_dbo_yield_outside_a_ubatch_is_a_no_op():
    """Hooks are per thread: a yield from another thread, while ubatches run, neither blocks nor switches them."""
    log = []
    ubatch_waiting = threading.Event()
    outsider_done = threading.Event()

    def first():
        log.append("a0")
        ubatch_waiting.set()
        assert outsider_done.wait(5)  # holds the turn while the outsider yields
        log.append("a1")
        dbo_yield()
        log.append("a2")

    def second():
        log.append("b0")
        dbo_yield()
        log.append("b1")

    def outsider():
        assert ubatch_waiting.wait(5)
        dbo_yield()
        log.append("outsider")
        outsider_done.set()

    side = threading.Thread(target=outsider)
    side.start()
    run_ubatches([first, second])
    side.join(5)
    assert log == ["a0", "outsider", "a1", "b0", "a2", "b1"]
    dbo_yield()  # and on the caller's thread after the run
    assert not _ubatch_threads()


@pytest.mark.parametrize("failing", [0, 1])
def test_failing_ubatch_is_named_and_nothing_hangs(failing):
    def task(i):
        def run():
            for step in range(10):
                if i == failing and step == 3:
                    raise KeyError("boom")
                dbo_yield()

        return run

    start = time.monotonic()
    with pytest.raises(UBatchError, match=f"ubatch {failing} failed: KeyError") as e:
        run_ubatches([task(0), task(1)])
    assert time.monotonic() - start < 5
    assert e.value.ubatch_id == failing and isinstance(e.value.__cause__, KeyError)
    assert not _ubatch_threads()
