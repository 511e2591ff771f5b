"""Keep freed memory inside glibc's heap, so a step's large tensors reuse warm pages.

By default glibc hands large blocks (mmap) and the heap's free top back to the kernel, and every new tensor of
the next step then faults its pages in again: ~850K minor faults per 4096-token prefill of the benchmark
model, a third of the step's time. Raising both thresholds keeps those pages mapped; the process's resident
memory then stays at its peak, as it would under jemalloc or tcmalloc.
"""
from __future__ import annotations

import ctypes
import platform
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
KEEP_BYTES = 1 << 30  # blocks up to this size come from the heap; mallopt takes an int, so it must stay < 2**31


def keep_freed_memory() -> bool:
    """Tune glibc's malloc for this process; False where the C library is not glibc (nothing changes)."""
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)) and bool(libc.mallopt(M_MMAP_THRESHOLD, KEEP_BYTES))
