"""Giving glibc's free heap pages back to the system (`malloc_trim`) after optimizer steps.

glibc serves allocations below its mmap threshold (which rises to 32 MiB once a block that
large is freed) from the heap, where blocks of different lifetimes interleave and the holes
they leave stay resident: glibc gives back only the free space at the top of the heap.
`malloc_trim(0)` returns the free pages inside the heap as well. The holes that stay come
from the first step (its one-off allocations: the optimizer's states, the recorded gather
order), and later steps reuse their own, so zeroshard trims after the first step and after
that only when a step's resident memory grew by more than GROWTH; a trim after every step
would make each step fault its transient pages in again. The measurements behind this rule
are in bench/RESULTS.md (2026-12-01, 150M stage 3: `malloc_trim(0)` variants).

While it is on, zeroshard also decides alone when the heap's free *top* goes back: glibc's
own rule returns it at every free that leaves more than M_TRIM_THRESHOLD there (twice the mmap
threshold, so up to 64 MiB), which stage 3 does at the end of every backward (its gradients and
activations are freed, nothing above them stays), and the next forward faults all of it in again
(150M stage 3 on 2 ranks: 26,000-84,000 page faults a step, against a few hundred to 12,300
with the top kept). So each engine fixes M_TRIM_THRESHOLD at 2 GiB and M_MMAP_THRESHOLD at
32 MiB (glibc's dynamic maximum, which fixing the trim threshold would otherwise freeze wherever
it stood) with `mallopt`: process-wide settings, the same values for every engine.

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


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
HEAP_TOP_KEPT = 2**31 - 1  # bytes of free heap top glibc may keep (mallopt takes a C int)
MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit


def _keep_heap_top() -> bool:
    """glibc keeps the heap's free top (below 2 GiB) and maps only blocks of 32 MiB or more."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, HEAP_TOP_KEPT))


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
        self.top_kept = self._fn is not None and _keep_heap_top()
        if self._fn is not None:
            self.line = ("glibc's free heap pages go back to the system (malloc_trim) after the first step "
                         "and after any step whose resident memory grew by more than 5 %, so the peak RSS "
                         "counts the memory a step touches and not the holes earlier steps left"
                         + ("; between those, the heap's free top stays (M_TRIM_THRESHOLD 2 GiB, "
                            "M_MMAP_THRESHOLD 32 MiB), not faulted in again every step" if self.top_kept else "")
                         + "; zeroshard.trim_host_memory: false turns this off")
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
