"""Make collectives take as long as a given link would, to emulate NVLink or InfiniBand on one machine."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Protocol


class Work(Protocol):
    def wait(self) -> object: ...


@dataclass(eq=False)
class LinkEmulator:
    """This rank's link: `latency_us` per transfer, `bandwidth_gbps` (gigabytes/s) shared by all transfers.

    A collective completes no earlier than latency + bytes / bandwidth after it was issued, later when
    earlier transfers still occupy the link (the two ubatches' transfers queue, as on a real link).
    Zero latency and None bandwidth: no emulation.
    """

    latency_us: float = 0.0
    bandwidth_gbps: float | None = None
    _free_at: float = field(default=0.0, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.latency_us < 0:
            raise ValueError(f"link_latency_us must be >= 0, got {self.latency_us}")
        if self.bandwidth_gbps is not None and self.bandwidth_gbps <= 0:
            raise ValueError(f"link_bandwidth_gbps must be positive (or None for unlimited), got {self.bandwidth_gbps}")

    @property
    def enabled(self) -> bool:
        return self.latency_us > 0 or self.bandwidth_gbps is not None

    def wire_time(self, num_bytes: int) -> float:
        """Seconds `num_bytes` occupy the link."""
        return 0.0 if self.bandwidth_gbps is None else num_bytes / (self.bandwidth_gbps * 1e9)

    def transfer_time(self, num_bytes: int) -> float:
        """Seconds a transfer of `num_bytes` takes on an idle link."""
        return self.latency_us * 1e-6 + self.wire_time(num_bytes)

    def wrap(self, work: Work, num_bytes: int) -> Work:
        """`work`, whose wait() returns no earlier than the emulated link delivers `num_bytes` issued now."""
        if not self.enabled:
            return work
        with self._lock:
            start = max(time.perf_counter(), self._free_at)
            self._free_at = start + self.wire_time(num_bytes)
            deadline = self._free_at + self.latency_us * 1e-6
        return EmulatedWork(work, deadline)


class EmulatedWork:
    """A collective's handle that completes no earlier than `deadline` (perf_counter seconds)."""

    def __init__(self, work: Work, deadline: float) -> None:
        self.work = work
        self.deadline = deadline

    def wait(self) -> bool:
        self.work.wait()
        # Sleeping releases the GIL: the other ubatch computes while this one "transfers".
        remaining = self.deadline - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        return True
