"""The link emulator: completion no earlier than latency + bytes / bandwidth, a shared link, overlap under DBO."""
from __future__ import annotations

import time

import pytest

from latentserve.distributed.link_emulator import LinkEmulator
from latentserve.forward_context import dbo_yield
from latentserve.ubatch.runner import run_ubatches


class Done:
    """A collective that has already completed."""

    def wait(self) -> bool:
        return True


def _timed_wait(work) -> float:
    start = time.perf_counter()
    work.wait()
    return time.perf_counter() - start


def test_transfer_time():
    link = LinkEmulator(latency_us=100.0, bandwidth_gbps=2.0)
    assert link.transfer_time(4_000_000) == pytest.approx(100e-6 + 4e6 / 2e9)
    assert LinkEmulator(latency_us=5.0).transfer_time(10**9) == pytest.approx(5e-6)


def test_no_emulation_returns_the_work_itself():
    work = Done()
    assert LinkEmulator().wrap(work, 10**9) is work


def test_wait_lasts_until_the_transfer_would_arrive():
    link = LinkEmulator(latency_us=20_000.0, bandwidth_gbps=1.0)
    start = time.perf_counter()
    work = link.wrap(Done(), 30_000_000)  # 20 ms + 30 ms
    work.wait()
    assert time.perf_counter() - start >= 0.05
    assert _timed_wait(link.wrap(Done(), 0)) >= 0.015  # latency only, but queued behind nothing now


def test_time_spent_computing_after_issue_is_not_added():
    link = LinkEmulator(latency_us=30_000.0)
    work = link.wrap(Done(), 0)
    time.sleep(0.04)  # "compute" longer than the transfer
    assert _timed_wait(work) < 0.01


def test_transfers_share_the_link():
    link = LinkEmulator(bandwidth_gbps=1.0)
    start = time.perf_counter()
    first, second = link.wrap(Done(), 30_000_000), link.wrap(Done(), 30_000_000)
    first.wait()
    second.wait()
    assert time.perf_counter() - start >= 0.06  # the second waits for the first to leave the wire


def test_ubatches_overlap_their_transfers_latency():
    """Each ubatch yields while its transfer is in flight: two 100 ms latencies overlap instead of adding up."""
    link = LinkEmulator(latency_us=100_000.0)

    def ubatch() -> None:
        work = link.wrap(Done(), 0)
        dbo_yield()
        work.wait()

    start = time.perf_counter()
    run_ubatches([ubatch, ubatch])
    assert 0.1 <= time.perf_counter() - start < 0.18


def test_bad_settings():
    with pytest.raises(ValueError, match="link_latency_us must be >= 0"):
        LinkEmulator(latency_us=-1.0)
    with pytest.raises(ValueError, match="link_bandwidth_gbps must be positive"):
        LinkEmulator(bandwidth_gbps=0.0)
