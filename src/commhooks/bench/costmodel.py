"""Predict a hook's step time on a network from what a loopback run measured.

The model
---------
A step on a link is the step measured on loopback plus the time the link needs for the bytes:

    t_step(p, B) = t_compute + k * w(p) + 8 w(p) f / B + rounds(p) * a

* ``w(p)`` is the bytes one rank sends per step at world size ``p`` (below), ``f`` the wire
  factor (headers), ``B`` the link's rate in bit/s and ``a`` its one-way latency.
* ``k`` is the CPU time the backend spends per byte sent: copying into and out of the kernel,
  summing what arrives. It is paid on loopback too, where the link itself costs next to
  nothing, so the allreduce and noop hooks measured there give it:
  ``k = (t_allreduce - t_noop) / w_allreduce(p)``.
* ``t_compute`` is the rest of the loopback step (forward, backward, optimizer, the hook's own
  compression work): ``t_loopback - k * w(p)`` at the world size measured. At that world size
  the prediction is therefore ``t_loopback + 8 w f / B + latency``, whatever ``k`` is; ``k``
  only matters for another world size, where each rank sends another number of bytes.

A ring allreduce of ``n`` bytes over ``p`` ranks runs a reduce-scatter and an all-gather of
``p - 1`` rounds each, every rank sending ``n / p`` bytes per round, all links busy at once: a
rank sends ``2 (p - 1) / p * n`` bytes, which approaches ``2 n`` whatever the world size, and
waits ``2 (p - 1)`` latencies. An all-gather in which each rank contributes ``n`` bytes is
half a ring, ``(p - 1) n``; a pipelined broadcast sends ``n`` bytes per rank; reduce-scatter
and all-to-all send ``(p - 1) / p`` of their input. ``TCP_WIRE_FACTOR`` turns payload into
bytes on an Ethernet wire: a 1500-byte MTU carries 1448 payload bytes in a 1514-byte frame.
``TCP_RING_WIRE_FACTOR``, the links' default, adds the acknowledgements: in a ring every rank
also receives as much as it sends, and acknowledges every second segment it receives with a
66-byte frame on its own link (measured on the bench's links: 1.070 bytes per payload byte).

The model assumes that communication does not overlap computation (DDP can overlap them: the
prediction is then an upper bound) and that the links, not a shared switch, are the limit.
"""

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "TCP_RING_WIRE_FACTOR",
    "TCP_WIRE_FACTOR",
    "Collectives",
    "Link",
    "LoopbackStep",
    "backend_s_per_byte",
    "break_even_bps",
    "comm_time_s",
    "predict_step_s",
    "predicted_step_s",
    "wire_bytes",
]

_ALL_GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_single")

TCP_WIRE_FACTOR = 1514 / 1448  # Ethernet + IPv4 + TCP (timestamps) headers per full segment
TCP_RING_WIRE_FACTOR = (1514 + 66 / 2) / 1448  # and half an acknowledgement per segment


@dataclass(frozen=True)
class Collectives:
    """One step's collectives as counted in a rank: calls and payload bytes per kind."""

    calls: Mapping[str, float]
    payload_bytes: Mapping[str, float]


@dataclass(frozen=True)
class Link:
    """A network link: its rate, one-way latency, and the wire bytes per payload byte."""

    bandwidth_bps: float
    latency_s: float = 0.0
    wire_factor: float = TCP_RING_WIRE_FACTOR


@dataclass(frozen=True)
class LoopbackStep:
    """One hook's mean step time measured on loopback, with what it sent, at ``world_size``."""

    step_s: float
    collectives: Collectives
    world_size: int


def wire_bytes(c: Collectives, world_size: int, wire_factor: float = 1.0) -> float:
    """Bytes one rank sends per step for collectives ``c`` (ring algorithms)."""
    p = world_size
    if p < 2:
        return 0.0
    total = 0.0
    for kind, n in c.payload_bytes.items():
        if kind == "all_reduce":
            total += 2 * (p - 1) / p * n
        elif kind in _ALL_GATHERS:  # n: what this rank contributes
            total += (p - 1) * n
        elif kind == "broadcast":  # pipelined along a chain: each rank forwards it once
            total += n
        else:  # reduce-scatter, all-to-all: each rank sends (p - 1) / p of its input
            total += (p - 1) / p * n
    return total * wire_factor


def _rounds(c: Collectives, world_size: int) -> float:
    """Latencies waited per step: 2 (p - 1) per allreduce, p - 1 per other collective."""
    p = world_size
    return sum(
        calls * (2 * (p - 1) if kind == "all_reduce" else p - 1) for kind, calls in c.calls.items()
    )


def comm_time_s(
    c: Collectives,
    world_size: int,
    bandwidth_bps: float,
    latency_s: float = 0.0,
    wire_factor: float = TCP_WIRE_FACTOR,
) -> float:
    """Seconds the link needs per step for collectives ``c`` (see the module docstring)."""
    if world_size < 2:
        return 0.0
    return (
        8 * wire_bytes(c, world_size, wire_factor) / bandwidth_bps
        + _rounds(c, world_size) * latency_s
    )


def predict_step_s(
    compute_s: float,
    c: Collectives,
    world_size: int,
    bandwidth_bps: float,
    latency_s: float = 0.0,
    overhead_s: float = 0.0,
    wire_factor: float = TCP_WIRE_FACTOR,
) -> float:
    """Seconds per step: compute, plus a hook's own overhead, plus the link's time."""
    return (
        compute_s + overhead_s + comm_time_s(c, world_size, bandwidth_bps, latency_s, wire_factor)
    )


def backend_s_per_byte(allreduce: LoopbackStep, noop: LoopbackStep) -> float:
    """``k``: the backend's CPU seconds per byte sent, from allreduce against noop on loopback.

    Zero when allreduce sent nothing or was not slower (a noisy measurement): the prediction at
    the world size measured does not depend on it.
    """
    sent = wire_bytes(allreduce.collectives, allreduce.world_size)
    if sent <= 0:
        return 0.0
    return max(0.0, allreduce.step_s - noop.step_s) / sent


def predicted_step_s(m: LoopbackStep, world_size: int, link: Link, s_per_byte: float) -> float:
    """Seconds per step of the hook measured as ``m``, on ``world_size`` ranks over ``link``:
    its computation, the backend's work for the bytes sent there, and the link's time."""
    compute = max(0.0, m.step_s - s_per_byte * wire_bytes(m.collectives, m.world_size))
    return predict_step_s(
        compute,
        m.collectives,
        world_size,
        link.bandwidth_bps,
        link.latency_s,
        overhead_s=s_per_byte * wire_bytes(m.collectives, world_size),
        wire_factor=link.wire_factor,
    )


def _split(m: LoopbackStep, world_size: int, link: Link, s_per_byte: float) -> tuple[float, float]:
    """``(a, b)`` such that the step takes ``a + b / B`` seconds on links of ``B`` bit/s."""
    endless = dataclasses.replace(link, bandwidth_bps=math.inf)
    bits = 8 * wire_bytes(m.collectives, world_size, link.wire_factor)
    return predicted_step_s(m, world_size, endless, s_per_byte), bits


def break_even_bps(
    hook: LoopbackStep, reference: LoopbackStep, world_size: int, link: Link, s_per_byte: float
) -> float | None:
    """The rate below which ``hook`` steps faster than ``reference``.

    Both step times are ``a + b / B``, so they cross at most once. ``link`` gives the latency
    and the wire factor; its rate is not used.

    Returns:
        the rate in bit/s; ``None`` when the hook is faster at every rate; ``0.0`` when no
        rate below some bound makes it faster (it sends at least as many bytes).
    """
    a_hook, b_hook = _split(hook, world_size, link, s_per_byte)
    a_ref, b_ref = _split(reference, world_size, link, s_per_byte)
    if b_hook >= b_ref:
        return None if b_hook == b_ref and a_hook < a_ref else 0.0
    if a_hook <= a_ref:
        return None
    return (b_ref - b_hook) / (a_hook - a_ref)
