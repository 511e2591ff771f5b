"""The link emulator: completion no earlier than latency + bytes / bandwidth, a shared link, overlap under DBO.

Time is the emulator's own: a fake clock that only its sleeps advance, so a loaded machine changes nothing.
"""
from __future__ import annotations

import pytest

from latentserve.distributed import link_emulator
from latentserve.distributed.link_emulator import LinkEmulator
from latentserve.forward_context import dbo_yield
from latentserve.ubatch.runner import run_ubatches


class Done:
    """A collective that has already completed."""

    def wait(self) -> bool:
        return True


class FakeClock:
    """Stands in for the `time` module inside the emulator: sleeping advances it, nothing else does."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    def compute(self, seconds: float) -> None:
        """Time spent by the caller between issuing a transfer and waiting for it."""
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(link_emulator, "time", fake)
    return fake


def test_transfer_time():
    link = LinkEmulator(latency_us=100.0, bandwidth_gbps=2.0)
    assert link.transfer_time(4_000_000) == pytest.approx(100e-6 + 4e6 / 2e9)
    assert LinkEmulator(latency_us=5.0).transfer_time(10**9) == pytest.approx(5e-6)


def test_no_emulation_returns_the_work_itself():
    work = Done()
    assert LinkEmulator().wrap(work, 10**9) is work


def test_wait_lasts_until_the_transfer_would_arrive(clock):
    link = LinkEmulator(latency_us=20_000.0, bandwidth_gbps=1.0)
    start = clock.now
    link.wrap(Done(), 30_000_000).wait()  # 20 ms + 30 ms
    assert clock.now - start == pytest.approx(0.05)
    start = clock.now
    link.wrap(Done(), 0).wait()  # latency only: the link is free again
    assert clock.now - start == pytest.approx(0.02)


def test_time_spent_computing_after_issue_is_not_added(clock):
    link = LinkEmulator(latency_us=30_000.0)
    work = link.wrap(Done(), 0)
    clock.compute(0.04)  # longer than the transfer
    work.wait()
    assert clock.slept == []


def test_transfers_share_the_link(clock):
    link = LinkEmulator(latency_us=1_000.0, bandwidth_gbps=1.0)
    start = clock.now
    first, second = link.wrap(Done(), 30_000_000), link.wrap(Done(), 30_000_000)
    # The second leaves the wire 30 ms after the first does; latency is not occupancy, so it is not queued.
    assert first.deadline - start == pytest.approx(0.031)
    assert second.deadline - start == pytest.approx(0.061)
    first.wait()
    second.wait()
    assert clock.now - start == pytest.approx(0.061)


def test_ubatches_overlap_their_transfers_latency(clock):
    """Each ubatch yields while its transfer is in flight: two 100 ms latencies overlap instead of adding up."""
    link = LinkEmulator(latency_us=100_000.0)
    deadlines = []

    def ubatch() -> None:
        work = link.wrap(Done(), 0)
        deadlines.append(work.deadline)
        dbo_yield()
        work.wait()

    start = clock.now
    run_ubatches([ubatch, ubatch])
    assert deadlines == [pytest.approx(start + 0.1)] * 2  # both issued before either waited
    assert clock.now - start == pytest.approx(0.1)


def test_bad_settings():
    with pytest.raises(ValueError, match="link_latency_us must be >= 0"):
        LinkEmulator(latency_us=-1.0)
    with pytest.raises(ValueError, match="link_bandwidth_gbps must be positive"):
        LinkEmulator(bandwidth_gbps=0.0)
