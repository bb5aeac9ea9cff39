"""The network's own rate and latency, measured before the hooks run: an allreduce sweep.

Every rank allreduces tensors of growing size (4 KiB up, four times larger each time, until
one takes longer than a quarter of a second or reaches 64 MiB), timed on the device's clock,
the median of a few repeats per size. In a ring allreduce of ``n`` bytes over ``p`` ranks each
rank sends ``w = 2 (p - 1) / p * n`` bytes in ``2 (p - 1)`` rounds, so the times lie on

    t(n) = 2 (p - 1) * latency + 8 w / rate

and the two largest sizes give the rate (their difference in time is the link's time for their
difference in bytes, whatever a rate limiter's burst or the backend's fixed costs add to both),
and the smallest, less its bytes' time at that rate, the latency. ``rate`` is what one rank's
link carries of allreduce payload per second (headers not counted), ``latency`` the time per
round that does not depend on size (the link's delay plus the backend's own cost per
message). On machines of several ranks the link is the machine's, and ``w`` what it carries:
the same ``2 (p - 1) / p * n`` for gloo's ring, whose boundary rank forwards the ring's
traffic, ``2 (N - 1) / N * n`` for NCCL's topology-aware allreduce over ``N`` machines. The fit
is pure arithmetic (:func:`fit_link`), tested apart from any network.
"""

import statistics
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from commhooks.bench.clock import DeviceClock
from commhooks.bench.shape import Shape
from commhooks.bench.units import format_rate

__all__ = ["LinkMeasure", "fit_link", "measure_link"]

FIRST_BYTES = 4 << 10
LAST_BYTES = 64 << 20
LONG_ENOUGH_S = 0.25
REPEATS = 5


@dataclass(frozen=True)
class LinkMeasure:
    """The measured network.

    Attributes:
        rate_bps: allreduce payload one rank's link carries per second, in bit/s (``None``
            when the times did not grow with size: too fast a link to tell).
        latency_s: seconds per ring round that do not depend on size.
        world_size: the ranks that took part.
        backend: the process group's backend.
        points: ``[bytes allreduced, median seconds]`` per size.
    """

    rate_bps: float | None
    latency_s: float
    world_size: int
    backend: str
    points: list[list[float]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form, with a sentence for the report."""
        return {
            "rate_bps": self.rate_bps,
            "latency_s": self.latency_s,
            "world_size": self.world_size,
            "backend": self.backend,
            "points": self.points,
            "text": self.text(),
        }

    def text(self) -> str:
        """One line: what was measured, and how."""
        rate = format_rate(self.rate_bps) if self.rate_bps else "too fast to tell"
        sizes = f"{_size(self.points[0][0])} to {_size(self.points[-1][0])}" if self.points else ""
        return (
            f"Your network, measured: {rate} of allreduce payload per rank, "
            f"{self.latency_s * 1e6:.0f} us per round ({self.backend}, {self.world_size} ranks, "
            f"allreduce of {sizes})"
        )


def _size(nbytes: float) -> str:
    return f"{nbytes / (1 << 20):g} MiB" if nbytes >= 1 << 20 else f"{nbytes / 1024:g} KiB"


def fit_link(
    points: list[list[float]], world_size: int, share: float | None = None
) -> tuple[float | None, float]:
    """``(rate_bps, latency_s)`` from ``[bytes allreduced, seconds]`` pairs in ascending size
    (see the module docstring); ``share``: the bytes a link carries per byte allreduced
    (default: a ring's, ``2 (p - 1) / p``). With one size only, its whole time is taken as
    the rate's; when the largest size took no longer than the one before, the rate is
    ``None``."""
    p = max(2, world_size)
    share = 2 * (p - 1) / p if share is None else share
    rounds = 2 * (p - 1)
    if not points:
        return None, 0.0
    if len(points) == 1:
        nbytes, seconds = points[0]
        return (8 * share * nbytes / seconds if seconds > 0 else None), 0.0
    (n0, t0), (n1, t1) = points[-2], points[-1]
    if t1 <= t0:
        return None, max(0.0, points[0][1]) / rounds
    s_per_byte = (t1 - t0) / (share * (n1 - n0))
    smallest_n, smallest_t = points[0]
    latency = max(0.0, smallest_t - s_per_byte * share * smallest_n) / rounds
    return 8 / s_per_byte, latency


def _time_allreduce(nbytes: int, group: Any, device: torch.device, clock: DeviceClock) -> float:
    tensor = torch.zeros(nbytes // 4, dtype=torch.float32, device=device)
    times = []
    for i in range(REPEATS + 1):  # the first one sets up buffers and connections: not kept
        dist.barrier(group=group, device_ids=[device.index] if device.type == "cuda" else None)
        start = clock.mark()
        dist.all_reduce(tensor, group=group)
        seconds = clock.seconds(start, clock.mark())
        if i:
            times.append(seconds)
    return statistics.median(times)


def _share(shape: Shape | None, backend: str) -> float | None:
    """Bytes a machine's link carries per byte allreduced over ``shape``: NCCL's allreduce
    crosses ``2 (N - 1) / N`` of it; gloo's ring (the default) a ring's share."""
    if shape is None or backend != "nccl" or shape.nodes < 2:
        return None
    return 2 * (shape.nodes - 1) / shape.nodes


def measure_link(
    group: Any, device: torch.device, clock: DeviceClock, shape: Shape | None = None
) -> LinkMeasure:
    """Allreduce on ``group`` at growing sizes on every rank; the fitted rate and latency of
    a machine's link (``shape``: the machines the ranks are on; default, each rank one).

    Every rank takes the same decisions (sizes, when to stop): the time that decides is the
    slowest rank's, agreed with a max-allreduce.
    """
    points: list[list[float]] = []
    nbytes = FIRST_BYTES
    while nbytes <= LAST_BYTES:
        slowest = torch.tensor([_time_allreduce(nbytes, group, device, clock)], device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        points.append([float(nbytes), float(slowest.item())])
        if points[-1][1] > LONG_ENOUGH_S:
            break
        nbytes *= 4
    world, backend = dist.get_world_size(group), str(dist.get_backend(group))
    rate, latency = fit_link(points, world, _share(shape, backend))
    return LinkMeasure(rate, latency, world, backend, points)
