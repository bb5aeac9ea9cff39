"""A rank's memory: its resident set, and an allocator set up so that the peak repeats.

A process's peak resident set also counts what glibc's allocator keeps after a free: a large
block goes to the heap rather than to a mapping of its own once frees have raised glibc's
threshold, later requests reuse its pages or split them, and the per-thread arenas (the hooks'
callbacks run on gloo's threads) each keep their own. Between two runs of one hook that part
moves the peak by about 5%, more than the difference between two hooks worth comparing.
Told to map every allocation of 64 KiB or more afresh and to unmap it on free
(:func:`map_large_allocations_afresh`), from before the task is built, the allocator keeps
nothing large: the peak is what the steps hold live, and repeats to a fraction of a MiB. Each
large allocation then costs page faults, so a run set up this way measures memory only.
"""

import ctypes
import os
import resource

__all__ = [
    "can_map_afresh",
    "map_large_allocations_afresh",
    "peak_rss_bytes",
    "reset_peak_rss",
    "rss_bytes",
]

_M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h
_FRESH_MAPPING_BYTES = 1 << 16


def rss_bytes() -> int:
    """The process's resident set now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """The process's peak resident set so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def reset_peak_rss() -> bool:
    """Start the peak resident set afresh from what is resident now (Linux: ``clear_refs``).

    A process that runs one hook after another (under torchrun) would otherwise report the
    largest earlier hook's peak for every later one.

    Returns:
        False where the kernel does not offer it (the peak then runs on from before).
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def can_map_afresh() -> bool:
    """Whether this process's allocator is glibc's, which :func:`map_large_allocations_afresh`
    needs."""
    return _glibc() is not None and os.path.exists("/proc/self/statm")


def map_large_allocations_afresh() -> bool:
    """From now on, map every allocation of 64 KiB or more on its own and unmap it on free.

    Fixing the threshold also stops glibc from raising it after frees. Free heap pages are
    returned first, so that what the process held before starts from its live part.

    Returns:
        False where the allocator is not glibc's (nothing changed).
    """
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, _FRESH_MAPPING_BYTES) == 1)
