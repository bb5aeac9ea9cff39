"""Where a step's time is read: the host's clock on a CPU, the device's own on a GPU.

On a GPU the host only queues work, and returns long before the device is done with it: the
time the host spends on a step says how much Python and launching cost, not how long the step
takes. A :class:`DeviceClock` marks points on the device's timeline (CUDA events) and reads
the time between two of them once the device has passed the second; on a CPU the same calls
read the host's clock, so one loop (``bench.worker``) measures both and the CPU path runs every
line of it.

Waiting for a mark polls instead of blocking in the driver: a step stuck behind a collective
that never completes then still returns to Python now and then, where the bench's deadline for
a hook (a ``SIGALRM``) can end it.
"""

import time
from typing import Any, Protocol

import torch

__all__ = ["CudaClock", "DeviceClock", "HostClock", "clock_for"]

_POLL_S = 0.0002


class DeviceClock(Protocol):
    """Marks on a device's timeline and the peak memory the device held."""

    def mark(self) -> Any:
        """A point on the device's timeline, after everything queued so far."""

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds between two marks; returns once the device has passed ``end``."""

    def reset_peak_memory(self) -> None:
        """Start counting the device's peak memory afresh."""

    def peak_memory_bytes(self) -> int | None:
        """The device's peak allocated memory since the last reset; ``None`` on a CPU."""


class HostClock:
    """A CPU's clock: a mark is the time it is taken, the work is done when it returns."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def reset_peak_memory(self) -> None:
        return None

    def peak_memory_bytes(self) -> int | None:
        return None


class CudaClock:
    """A GPU's clock: CUDA events on the current stream, read when the device passed them.

    DDP makes the current stream wait for its collectives before ``backward`` returns, so a
    mark after ``optimizer.step()`` comes after the step's communication too.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        while not end.query():  # type: ignore[no-untyped-call]
            time.sleep(_POLL_S)
        return float(start.elapsed_time(end)) / 1e3

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_memory_bytes(self) -> int | None:
        return int(torch.cuda.max_memory_allocated(self.device))


def clock_for(device: torch.device) -> DeviceClock:
    """The clock that times work on ``device``."""
    return CudaClock(device) if device.type == "cuda" else HostClock()
