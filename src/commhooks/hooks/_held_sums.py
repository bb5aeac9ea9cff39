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

Hook modules must not use ``from __future__ import annotations``: DDP rejects string annotations.
"""

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from commhooks import comm, finiteness

__all__ = ["HeldSums", "held_sums"]

Future = torch.futures.Future


@dataclass
class _Filed:
    """One bucket: its buffer, its sum's future, the future DDP waits on, its repair rounds."""

    buffer: torch.Tensor
    summed: "Future[list[torch.Tensor]]"  # the collective's own: [the sum]
    out: "Future[torch.Tensor]"
    rounds: Callable[[], Sequence[comm.Round]]
    devices: list[torch.device]


class HeldSums:
    """The buckets of a step filed on one issuer, finished together (see the module's note)."""

    def __init__(self, issuer: comm.OrderedIssuer) -> None:
        self._issuer = issuer
        self._filed: dict[int, _Filed] = {}  # by the buffer's address, in the order filed

    def file(
        self,
        buffer: torch.Tensor,
        summed: "Future[list[torch.Tensor]]",
        rounds: Callable[[], Sequence[comm.Round]],
        last_bucket: bool,
    ) -> "Future[torch.Tensor]":
        """Hold ``buffer``'s ``summed`` until a bucket whose follow-ups are not held
        (:func:`commhooks.comm.follow_up_options`); the future holds ``buffer`` with the average
        cast back, or the average that ``rounds()`` (made only for a sum that is not finite)
        made instead."""
        # A bucket filed again before its step finished was abandoned with that step (DDP
        # reuses its buffers): it is dropped, so that no stale sum lands in the new one.
        ptr = buffer.data_ptr()
        stale = self._filed.pop(ptr, None)
        if stale is not None:
            abandoned = RuntimeError("a bucket's average was abandoned with its step")
            stale.out.set_exception(cast(Any, abandoned))
        devices, hold = comm.follow_up_options(buffer, last_bucket)
        out: Future[torch.Tensor] = comm.new_future(devices)
        self._filed[ptr] = _Filed(buffer, summed, out, rounds, devices)
        if not hold:
            self.finish()
        # ``out`` is completed by hand. A future derived from it with ``then`` fails as a real
        # error when a collective failed, which DDP reports with the backend's message; the
        # hand-made one would hold the exception as a value, which DDP fails to read as a tensor.
        return comm.then(out, _value)

    @property
    def pending(self) -> int:
        """Buckets filed and not finished yet (0 between steps)."""
        return len(self._filed)

    def finish(self) -> None:
        """Check every filed sum at once; cast the finite ones back, repair the others."""
        filed, self._filed = list(self._filed.values()), {}
        ready: list[tuple[_Filed, torch.Tensor]] = []
        for each in filed:
            try:
                ready.append((each, each.summed.wait()[0]))  # this stream waits for the sum's
            except BaseException as exc:  # a failed collective: that bucket's step fails
                each.out.set_exception(cast(Any, exc))
        sums = [_first(summed, each.buffer.numel()) for each, summed in ready]
        finite = finiteness.finite_each(sums)
        done = [(each, s) for (each, _), s, ok in zip(ready, sums, finite) if ok]
        if done:
            torch._foreach_copy_([each.buffer for each, _ in done], [s for _, s in done])
            comm.used_on_current_stream([s for _, s in done])  # made on DDP's stream
        for each, _ in done:
            each.out.set_result(each.buffer)
        for (each, summed), ok in zip(ready, finite):
            if not ok:
                self._repair(each, summed)

    def _repair(self, each: _Filed, summed: torch.Tensor) -> None:
        """The repair rounds of a sum that is not finite, issued now, in the issuer's order."""
        repaired = self._issuer.rounds(comm.completed(summed), each.rounds(), each.devices)
        comm.when_done(repaired, lambda fut: _forward(fut, each.out))


def _first(summed: torch.Tensor, numel: int) -> torch.Tensor:
    """The sum's first ``numel`` elements: itself where it has no more (a view costs the host
    a microsecond a bucket, and on a GPU a sum is the bucket's size)."""
    return summed if summed.numel() == numel else summed[:numel]


def _value(fut: "Future[torch.Tensor]") -> torch.Tensor:
    return fut.value()


def _forward(src: "Future[torch.Tensor]", dst: "Future[torch.Tensor]") -> None:
    try:
        value = src.value()
    except BaseException as exc:
        dst.set_exception(cast(Any, exc))
        return
    dst.set_result(value)


_held: "weakref.WeakKeyDictionary[comm.OrderedIssuer, HeldSums]" = weakref.WeakKeyDictionary()


def held_sums(issuer: comm.OrderedIssuer) -> HeldSums:
    """The held sums of ``issuer``'s group: shared by the hooks that share the issuer, which
    call it on one thread, one bucket after another."""
    held = _held.get(issuer)
    if held is None:
        held = _held[issuer] = HeldSums(issuer)
    return held
