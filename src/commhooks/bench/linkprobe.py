"""The network's own rate and latency, measured before the hooks run: an allreduce sweep.

Every rank allreduces tensors of growing size (4 KiB up, four times larger each time, until
one takes longer than a quarter of a second or reaches 64 MiB), timed on the device's clock,
the median of a few repeats per size. In a ring allreduce of ``n`` bytes over ``p`` ranks each
rank sends ``w = 2 (p - 1) / p * n`` bytes in ``2 (p - 1)`` rounds, so the times lie on

    t(n) = 2 (p - 1) * latency + 8 w / rate

and a least-squares line through ``(w, t)``, each point weighted by ``1 / t^2`` (so that the
small sizes, a thousandth of the large ones' time, still pin the intercept), gives both:
``rate`` is what one rank's link carries of allreduce payload per second (headers not
counted), ``latency`` the time per round that does not depend on size (the link's delay
plus the backend's own cost per message). The fit is pure arithmetic (:func:`fit_link`),
tested apart from any network.
"""

import statistics
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from commhooks.bench.clock import DeviceClock
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


def fit_link(points: list[list[float]], world_size: int) -> tuple[float | None, float]:
    """``(rate_bps, latency_s)`` from ``[bytes allreduced, seconds]`` pairs (see the module
    docstring); a negative intercept is taken as no latency."""
    p = world_size
    share = 2 * (p - 1) / p
    xs = [share * n for n, _ in points]
    ys = [t for _, t in points]
    if len(points) < 2 or p < 2:
        return None, max(0.0, ys[0] / (2 * max(1, p - 1))) if ys else 0.0
    weights = [1 / max(t, 1e-12) ** 2 for t in ys]
    total = sum(weights)
    mx = sum(w * x for w, x in zip(weights, xs)) / total
    my = sum(w * y for w, y in zip(weights, ys)) / total
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(weights, xs))
    sxy = sum(w * (x - mx) * (y - my) for w, x, y in zip(weights, xs, ys))
    slope = sxy / sxx if sxx > 0 else 0.0
    intercept = my - slope * mx
    rate = 8 / slope if slope > 0 else None
    return rate, max(0.0, intercept) / (2 * (p - 1))


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


def measure_link(group: Any, device: torch.device, clock: DeviceClock) -> LinkMeasure:
    """Allreduce on ``group`` at growing sizes on every rank; the fitted rate and latency.

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
    world = dist.get_world_size(group)
    rate, latency = fit_link(points, world)
    return LinkMeasure(rate, latency, world, str(dist.get_backend(group)), points)
