"""Giving glibc's free heap pages back to the system after optimizer steps.

glibc serves allocations below its mmap threshold from the heap. That threshold moves up to
32 MiB once a block that large is freed, so after the first step nearly all of stage 3's
transient buffers come from the heap: gathered units, full-size gradients, reduction buffers
and activations. Blocks of different lifetimes interleave there, and the holes they leave
stay resident. glibc gives back only the free space at the top of the heap.

Measured on this project's 2-core machine, with the peer harness at 150M, stage 3, 2 ranks:
after a step the main arena held 3.3-3.5 GB, of which 1.31-1.36 GB were in use. The peak RSS
per rank was 3,809-3,943 MiB. With every block of 64 KiB or more mmapped
(MALLOC_MMAP_THRESHOLD_=65536, far too slow to ship) it was 2,663 MiB. `malloc_trim(0)`
returns the free pages inside the heap as well (madvise), and the next step faults in only
the pages it really touches. Measured: 3,105-3,195 MiB with a trim after every step, and
2,999-3,003 MiB with one trim after the first step only. So the holes that stay come from
the first step (its one-off allocations: the optimizer's states, the recorded gather order),
and later steps reuse their own. A trim after every step would make each step fault its
transient pages in again. zeroshard therefore trims after the first step, and after that only
when a step's resident memory grew by more than 5 % over the previous step's. In the 150M round
of the peer harness with this rule the peak was 3,430-3,431 MiB. Single runs of one variant
vary by 100-300 MiB (bench/RESULTS.md).

On by default where the host is the memory being trained in (CPU training) or offloaded to;
`zeroshard.trim_host_memory` says otherwise. Elsewhere (no glibc: musl, macOS) it is off, and
the start-up line says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time


GROWTH = 0.05


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


class HeapTrim:
    def __init__(self, asked: bool | None, host_in_use: bool) -> None:
        """`asked`: the config's `zeroshard.trim_host_memory` (None: on when `host_in_use`)."""
        self._fn = _malloc_trim() if (asked if asked is not None else host_in_use) else None
        self.seconds = 0.0  # time spent trimming, for the step-time breakdown
        self.trims = 0
        self._previous: int | None = None  # resident bytes after the previous step, before any trim
        if self._fn is not None:
            self.line = ("glibc's free heap pages go back to the system (malloc_trim) after the first step "
                         "and after any step whose resident memory grew by more than 5 %, so the peak RSS "
                         "counts the memory a step touches and not the holes earlier steps left; "
                         "zeroshard.trim_host_memory: false turns this off")
        elif asked or (asked is None and host_in_use):
            self.line = "trim_host_memory: no glibc malloc_trim in this process; free heap pages stay resident"
        elif asked is False:
            self.line = "trim_host_memory: off (zeroshard.trim_host_memory: false)"
        else:
            self.line = "trim_host_memory: off (the host holds no training state here)"

    @property
    def active(self) -> bool:
        return self._fn is not None

    def __call__(self) -> None:
        """After a step: trim after the first one, then only when the resident memory has grown
        by more than GROWTH since the previous step (steady steps reuse their holes; a trim then
        would only make the next step fault its pages in again)."""
        if self._fn is None:
            return
        rss = _resident_bytes()
        if self._previous is not None and rss <= self._previous * (1 + GROWTH):
            self._previous = rss
            return
        started = time.perf_counter()
        self._fn(0)
        self.seconds += time.perf_counter() - started
        self.trims += 1
        self._previous = rss
