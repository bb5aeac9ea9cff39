"""Predict a hook's step time on a cluster from what a loopback run measured.

The model
---------
A step on a cluster is the step measured on loopback plus the time the machines' links need:

    t_step = t_compute + k * w_rank + sum over collective calls of t_link(call) + rounds * a

* The cluster is ``N`` machines of ``G`` ranks (:class:`~commhooks.bench.shape.Shape`), each
  machine with one link of ``B`` bit/s and one-way latency ``a``; the inside of a machine is
  free, or priced at its own rate (``intra_bps``). Ranks of a machine are consecutive.
* ``w_rank`` is the bytes one rank hands the network per step (the ring model of
  :func:`wire_bytes`) and ``k`` the CPU seconds the backend spends per such byte (copying into
  and out of the kernel, summing): ``k = (t_allreduce - t_noop) / w_allreduce`` on loopback,
  where the link itself costs next to nothing. ``t_compute = t_loopback - k * w_rank`` at the
  shape measured; there the prediction is ``t_loopback + link time``, whatever ``k`` is.
* What a machine's link sends per step (:func:`machine_bytes`) follows each collective's
  algorithm, for a collective of ``S`` bytes over ``W = N G`` ranks: gloo's ring allreduce
  ``2 (W - 1) / W * S`` (the machine's boundary rank forwards the ring's traffic), NCCL's,
  topology-aware, ``2 (N - 1) / N * S``; an all-to-all ``G (N - 1) / N * S`` (every rank sends
  what the other machines' ranks own); a ring all-gather ``(W - 1) / W * S`` (gloo's and
  NCCL's all-gather are rings); gloo's reduce-scatter is an allreduce; a broadcast ``S``.
  The quantized average's two hops (:mod:`commhooks.bench.paths` says when a hook takes them)
  exchange only the machine's share across: ``2 (N - 1) / N * S_q`` a machine.
* Gloo's exchanges are rendezvous: a rank sends only once its peer has said it is ready to
  receive, and that notice travels behind whatever the peer is already sending on the same
  connection. An all-to-all or an all-gather between two ranks sends before it receives, so
  the rank that arrives second sends its payload first and its own notice after it: the two
  directions of the link take turns. Measured on two namespaces at 100 Mbit/s: an all-to-all
  of 254 KB each way takes 2.0 times its bytes' time, the all-gather (two half chunks)
  1.5 times, the ring allreduce (receives posted first) 1.0. :data:`GLOO_TURNS` holds those
  patterns; with more ranks the peers differ and both directions run at once, as they do
  when the G ranks of a machine each exchange their share with their counterparts on two
  hops (on two machines of two ranks: int8's step predicted 39% over the measured one with
  turns, within 15% without). A large exchange on gloo is issued as several collectives at
  once (:func:`commhooks.comm.exchange_pieces`): only its first piece takes turns.
* A token-bucket link (``tc tbf``, a cloud's rate limit) lets ``burst_bytes`` through at once
  each time a direction starts after being idle: each turn of such a pattern starts afresh.
  The bench's own links have a 2 ms bucket; a wire has none (``burst_bytes=0``).
* ``TCP_WIRE_FACTOR`` turns payload into bytes on an Ethernet wire: a 1500-byte MTU carries
  1448 payload bytes in a 1514-byte frame. ``TCP_RING_WIRE_FACTOR``, the links' default, adds
  the acknowledgements: a direction that also receives acknowledges every second segment with a
  66-byte frame (measured on the bench's links: 1.070 bytes per payload byte).

The model assumes that communication does not overlap computation (DDP overlaps a bucket's
communication with the backward pass of the buckets after it: the prediction is then an upper
bound) and that the machines' links, not a shared switch, are the limit.
"""

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from commhooks import comm
from commhooks.bench.shape import Shape

__all__ = [
    "GLOO_TURNS",
    "TCP_RING_WIRE_FACTOR",
    "TCP_WIRE_FACTOR",
    "Cluster",
    "Collectives",
    "Link",
    "LoopbackStep",
    "backend_s_per_byte",
    "break_even_bps",
    "comm_time_s",
    "link_time_s",
    "machine_bytes",
    "predict_step_s",
    "predicted_step_s",
    "step_transfers",
    "transfers",
    "wire_bytes",
]

_ALL_GATHERS = ("all_gather", "all_gather_into_tensor", "all_gather_single")
_ALL_TO_ALL = "all_to_all_single"
_REDUCE_SCATTER = "reduce_scatter_tensor"
_HOPPING = ("all_reduce", _ALL_TO_ALL, *_ALL_GATHERS)  # what a two-hop path takes across

TCP_WIRE_FACTOR = 1514 / 1448  # Ethernet + IPv4 + TCP (timestamps) headers per full segment
TCP_RING_WIRE_FACTOR = (1514 + 66 / 2) / 1448  # and half an acknowledgement per segment

# Gloo's exchanges between two ranks, in turns: per turn, the share of one direction's bytes
# it sends, and whether the direction starts it idle (a token bucket's burst then helps).
# All-to-all: the late rank's payload, then the early one's. All-gather in two half chunks:
# the late rank's first half; its second half beside the early rank's first; the early
# rank's second half.
Turn = tuple[float, bool]
GLOO_TURNS: dict[str, tuple[Turn, ...]] = {
    _ALL_TO_ALL: ((1.0, True), (1.0, True)),
    **{kind: ((0.5, True), (0.5, False), (0.5, True)) for kind in _ALL_GATHERS},
}
_ONE_TURN: tuple[Turn, ...] = ((1.0, True),)


@dataclass(frozen=True)
class Collectives:
    """One step's collectives as counted in a rank: calls and payload bytes per kind."""

    calls: Mapping[str, float]
    payload_bytes: Mapping[str, float]


@dataclass(frozen=True)
class Link:
    """A machine's network link: its rate, one-way latency, the wire bytes per payload byte,
    and the bytes a token bucket lets through at once after an idle spell."""

    bandwidth_bps: float
    latency_s: float = 0.0
    wire_factor: float = TCP_RING_WIRE_FACTOR
    burst_bytes: float = 0.0


@dataclass(frozen=True)
class LoopbackStep:
    """One hook's mean step time measured on loopback, with what it sent, on ``world_size``
    ranks (an int: machines of one rank; or the shape they ran as).

    Attributes:
        two_hops: on which shapes the hook's quantized average takes two hops (the choice
            made in :func:`commhooks.bench.paths.two_hops`); ``None``: on none.
        summed_bytes: the float32 bytes per step the two hops sum inside a machine (the
            gradients averaged quantized), which ``intra_bps`` prices.
    """

    step_s: float
    collectives: Collectives
    world_size: "int | Shape"
    two_hops: "Callable[[Shape], bool] | None" = None
    summed_bytes: float = 0.0

    @property
    def shape(self) -> Shape:
        """The shape measured."""
        return _shape(self.world_size)

    def hops_on(self, shape: Shape) -> bool:
        """Whether the quantized average takes two hops on ``shape``."""
        return self.two_hops is not None and self.two_hops(shape)


@dataclass(frozen=True)
class Transfer:
    """One kind of collective of a step, as a machine's link sees it.

    Attributes:
        kind: the collective (``all_reduce``, ``all_to_all_single``...).
        calls: calls per step.
        machine_bytes: payload bytes one machine's link sends per call.
        members: the ranks of the group it runs over (two: gloo takes turns).
        intra_bytes: payload bytes one rank sends to ranks of its own machine per call.
        streams: exchanges of this kind that share the machine's link at once (on two hops,
            each of the machine's ranks with its counterparts); with several, one exchange's
            turns fill the other's idle direction, and the link runs both ways.
        pieces: the collectives a call is issued as (:func:`commhooks.comm.exchange_pieces`):
            only the first piece takes turns.
    """

    kind: str
    calls: float
    machine_bytes: float
    members: int
    intra_bytes: float = 0.0
    streams: int = 1
    pieces: int = 1


def _shape(world: "int | Shape") -> Shape:
    return world if isinstance(world, Shape) else Shape.of_ranks(world)


def _total(kind: str, per_rank: float, ranks: int) -> float:
    """A collective's whole payload ``S`` from what one rank handed it: an all-gather's
    input is one rank's contribution, every other collective's the whole."""
    return per_rank * ranks if kind in _ALL_GATHERS else per_rank


def _flat_bytes(kind: str, total: float, shape: Shape, backend: str) -> tuple[float, float]:
    """(machine link, one rank's intra-machine) payload bytes of one collective of ``total``
    bytes over every rank of ``shape`` (see the module docstring)."""
    n, g, w = shape.nodes, shape.per_node, shape.ranks
    ring = 2 * (w - 1) / w * total
    if kind == "all_reduce" or (kind == _REDUCE_SCATTER and backend == "gloo"):
        cross = 2 * (n - 1) / n * total if backend == "nccl" else ring
        return (cross if n > 1 else 0.0), (ring if g > 1 else 0.0)
    if kind in _ALL_GATHERS or kind == _REDUCE_SCATTER:  # rings (NCCL's reduce-scatter too)
        gathered = (w - 1) / w * total
        return (gathered if n > 1 else 0.0), (gathered if g > 1 else 0.0)
    if kind == "broadcast":
        return (total if n > 1 else 0.0), (total if g > 1 else 0.0)
    # all-to-all: each rank sends every other rank what it owns
    return g * (n - 1) / n * total, (g - 1) / w * total


def transfers(
    c: Collectives,
    measured: "int | Shape",
    shape: "int | Shape",
    backend: str = "gloo",
    two_hops: bool = False,
    measured_two_hops: bool = False,
    summed_bytes: float = 0.0,
) -> list[Transfer]:
    """What one step's collectives ``c``, counted in a rank of a run on ``measured``, put on a
    machine's link at ``shape``; ``two_hops``, ``measured_two_hops``: the quantized average
    (its all-to-all and all-gather) takes two hops there, took them in the run measured, the
    machine summing ``summed_bytes`` (float32) inside first."""
    before, after = _shape(measured), _shape(shape)
    flat, summed = _as_flat(c, before) if measured_two_hops else (c, summed_bytes)
    out = []
    for kind, per_rank in flat.payload_bytes.items():
        calls = flat.calls.get(kind, 0.0)
        if calls <= 0 or per_rank <= 0:
            continue
        each = _total(kind, per_rank, before.ranks) / calls
        if two_hops and (kind in _HOPPING):
            out.append(_across(kind, calls, each, after, summed / calls))
            continue
        cross, intra = _flat_bytes(kind, each, after, backend)
        rank_bytes = each / after.ranks if kind in _ALL_GATHERS else each
        pieces = _pieces(kind, rank_bytes, backend) if after.nodes > 1 else 1
        out.append(Transfer(kind, calls, cross, after.ranks, intra, pieces=pieces))
    return out


def _pieces(kind: str, rank_bytes: float, backend: str) -> int:
    """The collectives a call of ``kind``, handed ``rank_bytes`` by a rank, is issued as."""
    split = kind in (_ALL_TO_ALL, "all_gather_into_tensor")
    return comm.exchange_pieces(rank_bytes, backend) if split else 1


def _as_flat(c: Collectives, measured: Shape) -> tuple[Collectives, float]:
    """Collectives counted on the two hops, as the flat path would have counted them, and the
    float32 bytes summed inside the machine per step.

    On the two hops a rank hands the machine's reduce-scatter the bucket (float32), the
    all-to-all across a ``G``-th of the quantized bucket, and all-gathers both that share's
    average across and the float32 share inside; the flat path's all-to-all takes the whole
    quantized bucket, its all-gather a ``W``-th of it.
    """
    calls = c.calls.get(_ALL_TO_ALL, 0.0)
    quantized = c.payload_bytes.get(_ALL_TO_ALL, 0.0) * measured.per_node
    kept = {k: v for k, v in c.payload_bytes.items() if k not in (_REDUCE_SCATTER, *_ALL_GATHERS)}
    kept_calls = {k: v for k, v in c.calls.items() if k in kept}
    gathered = "all_gather_into_tensor"
    flat = Collectives(
        {**kept_calls, gathered: calls},
        {**kept, _ALL_TO_ALL: quantized, gathered: quantized / measured.ranks},
    )
    return flat, c.payload_bytes.get(_REDUCE_SCATTER, 0.0)


def _across(kind: str, calls: float, each: float, shape: Shape, summed: float) -> Transfer:
    """A collective in two hops: the machine's ``G`` ranks each take a ``G``-th of it across,
    with their counterparts on the other machines, after summing inside the machine.

    The quantized average's all-to-all and all-gather each send ``N - 1`` of ``N`` of the
    machine's share, after a float32 reduce-scatter of ``summed`` bytes inside (with the
    all-to-all) or before an all-gather inside (with the all-gather). An allreduce (DiLoCo's
    float32 sync with workers of a machine's ranks) is a ring over the ``N`` machines of each
    ``G``-th: ``2 (N - 1) / N`` of it a machine.
    """
    n, g = shape.nodes, shape.per_node
    if kind == "all_reduce":
        return Transfer(kind, calls, 2 * (n - 1) / n * each, n, 2 * (g - 1) / g * each, g)
    return Transfer(kind, calls, (n - 1) / n * each, n, (g - 1) / g * summed, g)


def machine_bytes(steps: list[Transfer]) -> float:
    """Payload bytes one machine's link sends per step for ``steps`` (the payload model)."""
    return sum(t.calls * t.machine_bytes for t in steps)


def wire_bytes(
    c: Collectives,
    world_size: "int | Shape",
    wire_factor: float = 1.0,
    measured: "int | Shape | None" = None,
) -> float:
    """Bytes one rank hands the network per step for collectives ``c``, counted in a rank of a
    run on ``measured`` ranks (``world_size``'s where not given), over ``world_size`` ranks
    (ring algorithms), wherever they go: what the backend's per-byte work is counted on."""
    p = _shape(world_size).ranks
    if p < 2:
        return 0.0
    counted_on = p if measured is None else _shape(measured).ranks
    total = 0.0
    for kind, n in c.payload_bytes.items():
        if kind == "all_reduce":
            total += 2 * (p - 1) / p * n
        elif kind in _ALL_GATHERS:  # n: this rank's share of a whole that stays (see _total)
            total += (p - 1) / p * _total(kind, n, counted_on)
        elif kind == "broadcast":  # pipelined along a chain: each rank forwards it once
            total += n
        else:  # reduce-scatter, all-to-all: each rank sends (p - 1) / p of its input
            total += (p - 1) / p * n
    return total * wire_factor


def _call_s(t: Transfer, link: Link, backend: str) -> float:
    """Seconds one call of ``t`` keeps the machine's link busy, turn by turn."""
    alone = backend == "gloo" and t.members == 2 and t.streams == 1
    turns = GLOO_TURNS.get(t.kind, _ONE_TURN) if alone else _ONE_TURN
    first = t.machine_bytes / t.pieces  # the rest of the pieces run both ways at once
    nbytes = t.machine_bytes - first
    for share, idle in turns:
        nbytes += max(0.0, share * first - link.burst_bytes) if idle else share * first
    return 8 * nbytes * link.wire_factor / link.bandwidth_bps


def _rounds(t: Transfer) -> float:
    """Latencies waited per call: ``2 (p - 1)`` per ring allreduce, ``p - 1`` otherwise."""
    p = t.members
    return 2 * (p - 1) if t.kind == "all_reduce" else p - 1


def link_time_s(
    steps: list[Transfer], link: Link, backend: str = "gloo", intra_bps: float | None = None
) -> float:
    """Seconds the machines' links (and, at ``intra_bps``, the insides of the machines) need
    per step for ``steps``."""
    seconds = 0.0
    for t in steps:
        if t.machine_bytes > 0:
            seconds += t.calls * (_call_s(t, link, backend) + _rounds(t) * link.latency_s)
        if intra_bps and t.intra_bytes > 0:
            seconds += t.calls * 8 * t.intra_bytes / intra_bps
    return seconds


def comm_time_s(
    c: Collectives,
    world_size: "int | Shape",
    bandwidth_bps: float,
    latency_s: float = 0.0,
    wire_factor: float = TCP_WIRE_FACTOR,
    backend: str = "gloo",
) -> float:
    """Seconds the links need per step for collectives ``c`` counted on ``world_size`` ranks,
    on that same cluster (see the module docstring)."""
    link = Link(bandwidth_bps, latency_s, wire_factor)
    return link_time_s(transfers(c, world_size, world_size, backend), link, backend)


def predict_step_s(
    compute_s: float,
    c: Collectives,
    world_size: "int | Shape",
    bandwidth_bps: float,
    latency_s: float = 0.0,
    overhead_s: float = 0.0,
    wire_factor: float = TCP_WIRE_FACTOR,
) -> float:
    """Seconds per step: compute, plus a hook's own overhead, plus the links' time."""
    comm = comm_time_s(c, world_size, bandwidth_bps, latency_s, wire_factor)
    return compute_s + overhead_s + comm


def backend_s_per_byte(allreduce: LoopbackStep, noop: LoopbackStep) -> float:
    """``k``: the backend's CPU seconds per byte sent, from allreduce against noop on loopback.

    Zero when allreduce sent nothing or was not slower (a noisy measurement): the prediction at
    the shape measured does not depend on it.
    """
    sent = wire_bytes(allreduce.collectives, allreduce.world_size)
    if sent <= 0:
        return 0.0
    return max(0.0, allreduce.step_s - noop.step_s) / sent


@dataclass(frozen=True)
class Cluster:
    """Where a prediction is for: the shape, the backend, the inside of a machine."""

    shape: Shape
    backend: str = "gloo"
    intra_bps: float | None = None


def _cluster(target: "int | Shape | Cluster") -> Cluster:
    return target if isinstance(target, Cluster) else Cluster(_shape(target))


def step_transfers(m: LoopbackStep, cluster: Cluster) -> list[Transfer]:
    """What the step of the hook measured as ``m`` puts on the links of ``cluster``."""
    measured = m.shape
    return transfers(
        m.collectives,
        measured,
        cluster.shape,
        cluster.backend,
        m.hops_on(cluster.shape),
        m.hops_on(measured),
        m.summed_bytes,
    )


def predicted_step_s(
    m: LoopbackStep, target: "int | Shape | Cluster", link: Link, s_per_byte: float
) -> float:
    """Seconds per step of the hook measured as ``m``, on ``target`` (ranks, a shape, or a
    cluster) whose machines have ``link``: its computation, the backend's work for the bytes
    each rank sends there, and the links' time."""
    cluster = _cluster(target)
    measured = s_per_byte * wire_bytes(m.collectives, m.world_size)
    there = s_per_byte * wire_bytes(m.collectives, cluster.shape, measured=m.world_size)
    compute = max(0.0, m.step_s - measured)
    links = link_time_s(step_transfers(m, cluster), link, cluster.backend, cluster.intra_bps)
    return compute + there + links


def _split(m: LoopbackStep, cluster: Cluster, link: Link, s_per_byte: float) -> tuple[float, float]:
    """``(a, b)`` such that the step takes ``a + b / B`` seconds on links of ``B`` bit/s."""
    endless = dataclasses.replace(link, bandwidth_bps=math.inf, burst_bytes=0.0)
    at_one = dataclasses.replace(link, bandwidth_bps=1.0, latency_s=0.0, burst_bytes=0.0)
    bits = link_time_s(step_transfers(m, cluster), at_one, cluster.backend)
    return predicted_step_s(m, cluster, endless, s_per_byte), bits


def break_even_bps(
    hook: LoopbackStep,
    reference: LoopbackStep,
    target: "int | Shape | Cluster",
    link: Link,
    s_per_byte: float,
) -> float | None:
    """The rate below which ``hook`` steps faster than ``reference``.

    Both step times are ``a + b / B``, so they cross at most once. ``link`` gives the latency
    and the wire factor; its rate is not used.

    Returns:
        the rate in bit/s; ``None`` when the hook is faster at every rate; ``0.0`` when no
        rate below some bound makes it faster (it sends at least as many bytes).
    """
    cluster = _cluster(target)
    a_hook, b_hook = _split(hook, cluster, link, s_per_byte)
    a_ref, b_ref = _split(reference, cluster, link, s_per_byte)
    if b_hook >= b_ref:
        return None if b_hook == b_ref and a_hook < a_ref else 0.0
    if a_hook <= a_ref:
        return None
    return (b_ref - b_hook) / (a_hook - a_ref)
