"""Predict a hook's step time on another network from what one run measured.

The model
---------
A step is compute followed by communication that is not hidden behind it:

    t_step = t_compute + sum over the step's collectives c of t(c)

* ``t_compute`` is the step time of the ``noop`` hook, which communicates nothing: the floor.
  It includes the hook's own compression work only to the extent that ``noop`` does not, so a
  compressing hook's extra compute is taken from its own measurement (see ``overhead_s``).
* A ring allreduce of ``n`` bytes over ``p`` ranks runs a reduce-scatter and an all-gather of
  ``p - 1`` rounds each; in every round each rank sends ``n / p`` bytes to its neighbour, all
  links busy at once. On links of bandwidth ``B`` bit/s and one-way latency ``a``:

      t(allreduce, n) = 2 (p - 1) / p * 8 n / B  +  2 (p - 1) * a

  so the bytes each rank sends per allreduce, ``2 (p - 1) / p * n``, approach ``2 n``
  whatever the world size, while the latency term grows with ``p``.
* An all-gather in which each rank contributes ``n`` bytes is half a ring:
  ``(p - 1) * 8 n / B + (p - 1) * a``; a pipelined broadcast sends ``n`` bytes per rank;
  reduce-scatter and all-to-all send ``(p - 1) / p`` of their input.
* ``wire_factor`` turns payload into bytes on the wire: TCP/IP over Ethernet with a 1500-byte
  MTU carries 1448 payload bytes in a 1514-byte frame (plus the receiver's acknowledgements).

What one measurement tells: the noop floor ``t_compute``, the collectives per step and their
payload (counted in the rank processes), and the hook's own step time at the measured
bandwidth. ``overhead_s`` = measured - (floor + communication predicted at that bandwidth) is
the hook's extra compute (compression, error feedback), carried over unchanged. Predicting at
the measured bandwidth therefore returns the measurement; predicting with ``overhead_s = 0`` and
comparing is the model's own error, which the report records.

The model assumes no overlap of communication with backward computation (DDP can overlap
them, so it is an upper bound when buckets are small relative to the model) and links that
are the bottleneck (not CPU or memory bandwidth).
"""

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["TCP_WIRE_FACTOR", "Collectives", "comm_time_s", "predict_step_s", "wire_bytes"]

_ALL_GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_single")

TCP_WIRE_FACTOR = 1514 / 1448  # Ethernet + IPv4 + TCP (timestamps) headers per full segment


@dataclass(frozen=True)
class Collectives:
    """One step's collectives as counted in a rank: calls and payload bytes per kind."""

    calls: Mapping[str, float]
    payload_bytes: Mapping[str, float]


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


def comm_time_s(
    c: Collectives,
    world_size: int,
    bandwidth_bps: float,
    latency_s: float = 0.0,
    wire_factor: float = TCP_WIRE_FACTOR,
) -> float:
    """Seconds of communication per step on ``bandwidth_bps`` links (see the module docstring)."""
    p = world_size
    if p < 2:
        return 0.0
    rounds = 0.0
    for kind, calls in c.calls.items():
        rounds += calls * (2 * (p - 1) if kind == "all_reduce" else (p - 1))
    return 8 * wire_bytes(c, p, wire_factor) / bandwidth_bps + rounds * latency_s


def predict_step_s(
    compute_s: float,
    c: Collectives,
    world_size: int,
    bandwidth_bps: float,
    latency_s: float = 0.0,
    overhead_s: float = 0.0,
    wire_factor: float = TCP_WIRE_FACTOR,
) -> float:
    """Predicted seconds per step: floor + hook overhead + ring communication."""
    return (
        compute_s + overhead_s + comm_time_s(c, world_size, bandwidth_bps, latency_s, wire_factor)
    )
