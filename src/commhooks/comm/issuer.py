"""Follow-up collectives issued in the same order on every rank, whatever thread gets there first.

A collective that needs an earlier one's result (PowerSGD's ``Q`` after ``P``, the quantized
hook's all-gather after its all-to-all) starts in a future's callback, which gloo runs on its
worker threads, in a different order on each rank: PyTorch's PowerSGD aborts gloo there with a
"collective mismatch" as soon as a model has several buckets. :class:`OrderedIssuer` runs each
follow-up in the order its slot was reserved (on DDP's thread, in bucket order), on a group of
its own (with NCCL, whose callbacks run in order on DDP's thread, the hook's group).
"""

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from commhooks.comm.collectives import chain, fail, new_future
from commhooks.comm.groups import follow_up_group
from commhooks.comm.topology import Topology, TwoHops, two_hops

__all__ = ["HopIssuers", "IssuerPool", "OrderedIssuer", "issuer_for"]

T = TypeVar("T")
Future = torch.futures.Future


class OrderedIssuer:
    """Runs follow-up steps in the order their slots were reserved, each issuing at most one
    collective, on :attr:`group` only."""

    def __init__(self, group: dist.ProcessGroup | None = None, *, borrowed: bool = False) -> None:
        """``borrowed``: ``group`` is the hook's own (NCCL's follow-ups share it), kept weakly
        so as not to keep it alive once destroyed."""
        self._group = None if borrowed else group
        self._borrowed = weakref.ref(group) if borrowed and group is not None else None
        self._lock = threading.RLock()
        self._reserved = 0
        self._next = 0
        self._ready: dict[int, Callable[[], None]] = {}
        self._draining = False

    @property
    def group(self) -> dist.ProcessGroup:
        """The group of the follow-ups: the only group a step may issue a collective on."""
        group = self._group if self._borrowed is None else self._borrowed()
        if group is None and self._borrowed is None:
            raise RuntimeError(
                "OrderedIssuer: made without a group, so its steps cannot issue collectives; "
                "build it as OrderedIssuer(comm.follow_up_group(group))."
            )
        if group is None:
            raise RuntimeError(
                "OrderedIssuer: its process group is gone (destroyed with "
                "torch.distributed.destroy_process_group); register the hook again on the "
                "new group."
            )
        return group

    def then(
        self,
        after: "Future[Any]",
        step: Callable[[Any], "Future[T]"],
        devices: list[torch.device] | None = None,
    ) -> "Future[T]":
        """When ``after`` completes, run ``step(after's value)`` in a slot reserved now (call
        on the hook's thread).

        ``step`` issues at most one collective, on :attr:`group`, and returns a future; the
        future returned here holds its value. A failed ``after`` or ``step`` fails it and
        releases the slot. ``devices``: the CUDA devices whose streams the result synchronises.
        """
        with self._lock:
            slot = self._reserved
            self._reserved += 1
        out: Future[T] = new_future(devices)

        def on_done(done: "Future[Any]") -> None:
            self._start(slot, lambda: _run(step, done, out))

        after.add_done_callback(on_done)
        return out

    def _start(self, slot: int, run: Callable[[], None]) -> None:
        """File ``run`` for ``slot`` and run every filed step whose turn has come, in a loop
        never nested: a step completing at once (NCCL's) files the next from inside it."""
        with self._lock:
            self._ready[slot] = run
            if self._draining:
                return
            self._draining = True
            try:
                while self._next in self._ready:
                    self._ready.pop(self._next)()
                    self._next += 1
            finally:
                self._draining = False

    @property
    def pending(self) -> int:
        """Slots reserved but not run yet (0 between steps)."""
        with self._lock:
            return self._reserved - self._next


def _run(step: Callable[[Any], "Future[T]"], done: "Future[Any]", out: "Future[T]") -> None:
    """Run ``step`` on ``done``'s value and forward its result (or any error) to ``out``."""
    try:
        sent = step(done.wait())  # wait(): this stream waits for the input's, on a GPU
    except BaseException as exc:
        fail(out, exc)
        return
    chain(sent, out)


@dataclass(frozen=True)
class HopIssuers:
    """The follow-ups of a two-hop average, an issuer for each group they go on, so that a
    bucket's exchange across machines waits only for the earlier buckets' exchanges, not for
    their all-gathers: ``across`` the all-to-all (on the peers), ``gather`` the all-gather after
    it (on the peers' follow-up group), ``within`` the all-gather inside the machine. With NCCL
    ``across`` and ``gather`` are one issuer, its follow-ups running in order as they are
    queued."""

    across: OrderedIssuer
    gather: OrderedIssuer
    within: OrderedIssuer


class IssuerPool:
    """One :class:`OrderedIssuer` per group (kept weakly), for the hooks or states sharing it.

    Safe where the sharers reserve their slots in the same order on every rank (one thread, or
    threads that take turns, as DDP's backward and the optimizer's step), and cheaper: on gloo
    each follow-up group has its own connections and threads.
    """

    def __init__(self) -> None:
        self._issuers: weakref.WeakKeyDictionary[dist.ProcessGroup, OrderedIssuer] = (
            weakref.WeakKeyDictionary()
        )
        self._hops: weakref.WeakKeyDictionary[dist.ProcessGroup, TwoHops] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    def two_hops(self, group: dist.ProcessGroup, topology: Topology) -> tuple[TwoHops, HopIssuers]:
        """The groups of a two-hop average over ``group`` (made at the first call: collective)
        and the issuers of their follow-ups, shared, so that each group's keep one order."""
        hops = self._hops.get(group)
        if hops is None:
            hops = self._hops[group] = two_hops(group, topology)
        with self._lock:
            across, gather, within = (
                self._issuers.get(g) or self._issuers.setdefault(g, OrderedIssuer(g))
                for g in (hops.peers, hops.peers_follow, hops.intra_follow)
            )
        return hops, HopIssuers(across, gather, within)

    def issuer(self, group: dist.ProcessGroup) -> OrderedIssuer:
        """The issuer of ``group``'s follow-ups (the first call makes a group: collective)."""
        issuer = self._issuers.get(group)
        if issuer is not None:
            return issuer
        with self._lock:
            issuer = self._issuers.get(group)
            if issuer is None:
                follow_up = follow_up_group(group)
                issuer = OrderedIssuer(follow_up, borrowed=follow_up is group)
                self._issuers[group] = issuer
            return issuer


_stateless = IssuerPool()


def issuer_for(group: dist.ProcessGroup) -> OrderedIssuer:
    """The follow-up issuer of ``group`` that the stateless hooks share (the first call, at
    their first bucket, makes its group)."""
    return _stateless.issuer(group)
