"""A step's reduced-precision sums on a GPU, held until its last bucket, then finished together.

On a GPU each bucket's fp16/bf16 sum must be checked before it is cast back (an overflowed sum
is sent again, see :mod:`commhooks.hooks._half`), and reading the check makes the host wait
for the device, so the check is read once a step, at the last bucket. Finished one bucket at a
time, every bucket paid the host for a queued reduction, a copy to the host, an event, two
follow-up slots and two callbacks: about 90 us a bucket against PyTorch's 25 on NCCL's path,
measured on a CPU (``examples/host_cost.py --backend inline``). Here a bucket only files its
sum; at the last bucket (or at once, where follow-ups are not held) the filed sums are checked
with one batched reduction and one read (:func:`commhooks.finiteness.finite_each`), the finite
ones cast back with one batched copy, and only a sum that is not finite goes through the
issuer's repair rounds, in bucket order, the same on every rank (every rank holds the same
sums, so every rank takes the same branch).

The quantized hooks file their buckets here too, each with a :class:`Finisher` of its own:
what must be finite is the gathered rows' scales, and a finite bucket is decoded (and its
errors kept) where a sum would be cast back.

Hook modules must not use ``from __future__ import annotations``: DDP rejects string annotations.
"""

import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar

import torch

from commhooks import comm, finiteness

__all__ = ["Finisher", "HeldSums", "held_sums"]

Future = torch.futures.Future
_derive: Callable[..., Any] = torch._C.Future.then
# torch's ``Future.wait`` without its Python layer (a frame a bucket; the same call).
_wait: Callable[[Any], Any] = torch._C.Future.wait
# What makes a bucket's repair rounds from its buffer, called only for a sum that is not
# finite: one function for all the buckets of a hook, so that filing one makes nothing.
Rounds = Callable[[torch.Tensor], Sequence[comm.Round]]


class Finisher(Protocol):
    """How a filed bucket whose collective's result is not its sum is finished (the quantized
    hooks'), called at the step's finish, in the order the buckets were filed."""

    def checked(self) -> torch.Tensor:
        """What must be finite for the bucket to finish (its collective has completed)."""

    def apply(self) -> torch.Tensor:
        """Finish the bucket, its check passed: what its future holds."""


class _Filed:
    """One bucket: its buffer, its sum's future, what makes its repair rounds, and once its
    step is finished, what the future DDP waits on holds (``buffer``, or what repairing made)
    or the error that fails it."""

    __slots__ = ("buffer", "error", "finisher", "rounds", "summed", "value")

    def __init__(
        self,
        buffer: torch.Tensor,
        summed: "Future[Any] | None",
        rounds: "Rounds",
        finisher: Finisher | None,
    ) -> None:
        self.buffer, self.summed, self.rounds = buffer, summed, rounds
        self.finisher = finisher
        self.value: torch.Tensor = buffer
        self.error: BaseException | None = None

    def result(self, _gate: "Future[None]") -> torch.Tensor:
        """What the bucket's future holds once the step's gate opens (a callback of the gate:
        raising fails that bucket's future alone, as a real error DDP reports)."""
        if self.error is not None:
            raise self.error
        return self.value

    def settle(self, done: "Future[Any]") -> None:
        """Keep what a repair made, or its error."""
        try:
            self.value = done.value()
        except BaseException as exc:
            self.error = exc


class HeldSums:
    """The buckets of a step filed on one issuer, finished together (see the module's note).

    Each bucket's future is derived from one future of the step, its gate, opened once the
    step is finished: a bucket pays for one callback, not for a future of its own completed
    by hand (about 3 us a bucket on a CPU's host)."""

    def __init__(self, issuer: comm.OrderedIssuer) -> None:
        # Weakly: the held sums are kept by their issuer (see held_sums), and a strong
        # reference back would keep both alive for good.
        self._issuer = weakref.ref(issuer)
        self._filed: dict[int, _Filed] = {}  # by the buffer's address, in the order filed
        self._gate: Future[None] | None = None
        self._devices: list[torch.device] = []  # the CUDA devices of the step's buckets

    def file(
        self,
        buffer: torch.Tensor,
        summed: "Future[Any] | None",
        rounds: Rounds,
        last_bucket: bool,
        finisher: Finisher | None = None,
    ) -> "Future[torch.Tensor]":
        """Hold ``buffer``'s ``summed`` until the step's last bucket, or one whose follow-ups
        are not held (:func:`commhooks.comm.holds_follow_ups`); the future holds ``buffer``
        with the average cast back, or the average that ``rounds(buffer)`` (called only for a
        sum that is not finite) made instead. With a ``finisher``, ``summed`` is any
        collective's future (``None``: none to wait for), and the finisher says what must be
        finite and finishes the bucket instead of the cast."""
        key = buffer.data_ptr()
        # A bucket filed again before its step finished: that step was abandoned (DDP reuses
        # its buffers), and every bucket still held from it is dropped, so that no stale sum
        # lands in a new step's buffer.
        if key in self._filed:
            self._abandon()
        gate = self._gate
        if gate is None:
            self._devices = comm.future_devices(buffer)
            gate = self._gate = comm.new_future(self._devices)
        filed = self._filed[key] = _Filed(buffer, summed, rounds, finisher)
        # Derived with ``then``: a bucket that failed fails its future as a real error, which
        # DDP reports with the backend's message. Not through :func:`commhooks.comm.then`: the
        # gate is opened on this thread, or inside a callback that function tracks already
        # (:func:`_open_after`), which releases the gate's callbacks before its own. And
        # torch's ``Future.then`` without its Python layer: it returns the same future (of
        # torch's C class, as it does) in two thirds of the host time.
        out: Future[torch.Tensor] = _derive(gate, filed.result)
        if last_bucket or not comm.holds_follow_ups(self._devices):
            self.finish()
        return out

    @property
    def pending(self) -> int:
        """Buckets filed and not finished yet (0 between steps)."""
        return len(self._filed)

    def finish(self) -> None:
        """Check every filed sum at once; cast the finite ones back (or finish them with their
        finishers), repair the others, then open the step's gate."""
        filed, gate = self._filed.values(), self._gate
        self._filed, self._gate = {}, None
        if gate is None:
            return
        ready, checked = _arrived(filed)
        finite = finiteness.finite_each(checked)
        if all(finite):  # the usual step: nothing to repair
            _finish(ready, checked, self._devices)
            gate.set_result(None)
            return
        _finish(_kept(ready, finite), _kept(checked, finite), self._devices)
        devices = self._devices
        repairs = [
            self._repair(each, summed, devices)
            for each, summed, ok in zip(ready, checked, finite)
            if not ok
        ]
        _open_after(gate, repairs)

    def _abandon(self) -> None:
        """Fail every bucket held from a step whose last bucket never came."""
        abandoned = RuntimeError("a bucket's average was abandoned with its step")
        for each in self._filed.values():
            each.error = abandoned
        gate, self._filed, self._gate = self._gate, {}, None
        if gate is not None:
            gate.set_result(None)

    def _repair(
        self, each: _Filed, summed: torch.Tensor, devices: list[torch.device]
    ) -> "Future[Any]":
        """The repair rounds of a sum that is not finite, issued now, in the issuer's order;
        the future completes once ``each`` holds what they made."""
        issuer = self._issuer()
        if issuer is None:  # its hooks and states let go of it: nothing can issue the rounds
            each.error = RuntimeError("a held bucket's issuer is gone; its sum is not repaired")
            return comm.completed(None)
        repaired = issuer.rounds(comm.completed(summed), each.rounds(each.buffer), devices)
        return comm.then(repaired, each.settle)


def _open_after(gate: "Future[None]", repairs: "list[Future[Any]]") -> None:
    """Open ``gate`` now, or once every repair is done (where collectives complete later than
    they are issued, gloo's)."""
    if all(repair.done() for repair in repairs):
        gate.set_result(None)
        return
    comm.when_done(torch.futures.collect_all(repairs), lambda _: gate.set_result(None))


def _arrived(filed: "Iterable[_Filed]") -> tuple[list[_Filed], list[torch.Tensor]]:
    """The buckets whose collectives completed, and what must be finite of each: its sum
    (its bucket's length), or what its finisher says. A bucket whose collective failed keeps
    the error, which fails its future alone."""
    ready, checked = [], []
    for each in filed:
        try:
            # This stream waits for the collective's (a finisher's bucket may have none).
            value = None if each.summed is None else _wait(each.summed)
            if each.finisher is not None:
                checked.append(each.finisher.checked())
                ready.append(each)
                continue
        except BaseException as exc:
            each.error = exc
            continue
        assert value is not None, "a sum filed without a finisher has its future"
        summed, numel = value[0], each.buffer.numel()
        # A sum may be longer than its bucket; a view of one that is not costs the host a
        # microsecond a bucket.
        checked.append(summed if summed.numel() == numel else summed[:numel])
        ready.append(each)
    return ready, checked


T = TypeVar("T")


def _kept(items: list[T], finite: list[bool]) -> list[T]:
    return [item for item, ok in zip(items, finite) if ok]


def _finish(ready: list[_Filed], checked: list[torch.Tensor], devices: list[torch.device]) -> None:
    """Finish the buckets whose check passed: each finisher's in turn, then the sums copied
    into their buckets, cast back, in one batched copy (one kernel on a GPU)."""
    if any(each.finisher is not None for each in ready):
        plain = [(each.buffer, summed) for each, summed in zip(ready, checked) if _applied(each)]
        buffers, sums = [buffer for buffer, _ in plain], [summed for _, summed in plain]
    else:  # the half-precision hooks' step
        buffers, sums = [each.buffer for each in ready], checked
    if buffers:
        torch._foreach_copy_(buffers, sums)
        if devices:  # CUDA sums, made on DDP's stream
            comm.used_on_current_stream(sums)


def _applied(each: _Filed) -> bool:
    """Run ``each``'s finisher, if it has one (an error fails that bucket's future alone, as
    a real error); whether it is a plain sum still to be cast back."""
    if each.finisher is None:
        return True
    try:
        each.value = each.finisher.apply()
    except BaseException as exc:
        each.error = exc
    return False


_held: "weakref.WeakKeyDictionary[comm.OrderedIssuer, HeldSums]" = weakref.WeakKeyDictionary()


def held_sums(issuer: comm.OrderedIssuer) -> HeldSums:
    """The held sums of ``issuer``'s group: shared by the hooks that share the issuer, which
    call it on one thread, one bucket after another."""
    held = _held.get(issuer)
    if held is None:
        held = _held[issuer] = HeldSums(issuer)
    return held
