"""Averaging a bucket in float16 or bfloat16, and the rare bucket whose sum there is not finite.

The common path is PyTorch's own, pass for pass: cast the bucket down, divide by the world
size, sum across ranks, cast the sum back into the bucket. On CPU in bfloat16 the cast, the
division and the check below are one fused pass with PyTorch's bits (:mod:`commhooks.compress.cpu_kernels`):
PyTorch converts to bfloat16 in integer arithmetic, slower than to float16, and its two passes
made the bf16 hook take 1.16-1.17x the fp16 one's time (a 6M-element bucket, two ranks).
Whether every summed element stayed finite is learnt on the way: on CPU with one or two ranks
from a flag element that each rank sets in the division's own pass (:func:`_cast_down`),
otherwise from one more pass that adds the summed elements up (:func:`all_finite`). Nothing
else is allocated, copied or sent unless one did not, which takes one of:

* A rank's value beyond the reduced range (float16's is +-65504) whose average fits: its cast
  gave ``inf``. The elements where the sum is not finite are sent again, each rank dividing
  before the cast where its own cast overflowed; the sum of those is finite and is used.
* The average itself is beyond the range, or a gradient was ``inf``/``NaN``: the elements sent
  again are still not finite, and the whole bucket is averaged in its own precision, which is
  plain allreduce's result, non-finite gradients included. A finite average gets a warning.

Every rank decides on the sums, which are the same bits on every rank, so every rank takes the
same branch and issues the same collectives. Both decisions are follow-ups (they need a result
first), issued through the group's :class:`commhooks.comm.OrderedIssuer` in slots reserved when
the hook is called (on an accelerator, at the step's last bucket, for the buckets that need
them: see below). For DDP's own buckets on a CPU the first decision runs on DDP's thread, at
a later bucket's call once the sum is there or at the step's last bucket
(:func:`commhooks.comm.poll`), not in a callback on gloo's worker thread, which would take the
interpreter from the backward pass at every bucket; other callers' buckets keep the callback.

Per element on an accelerator: the cast, the division and the collective, queued on the
stream; each bucket's sum is then held, with the step's others, until its last bucket
(:mod:`commhooks.hooks._held_sums`, as :func:`commhooks.comm.holds_follow_ups` says), where one
batched reduction checks them all, the host reads it once (the one wait for the device in the
step), and one batched copy casts the finite ones back. Until then each bucket keeps its
reduced-precision sum, which the decision needs; only a sum that is not finite takes the
follow-up rounds below.

Hook modules must not use ``from __future__ import annotations``: DDP rejects string annotations.
"""

import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from commhooks import _reads, comm
from commhooks._warnings import warn_once
from commhooks.compress import cpu_kernels
from commhooks.hooks._held_sums import held_sums

__all__ = ["all_finite", "average_held", "average_in", "saturating_cast"]

Future = torch.futures.Future


def average_in(
    dtype: torch.dtype,
    buffer: torch.Tensor,
    group: dist.ProcessGroup,
    issuer: comm.OrderedIssuer,
    last_bucket: bool,
    owner: str,
    polled: bool = False,
) -> "Future[torch.Tensor]":
    """Average ``buffer`` across ``group`` in ``dtype``, where reading a check back is free (a
    CPU bucket; on a GPU :func:`average_held`); the future holds ``buffer``, averaged.

    Issues one collective on ``group`` now, and two follow-up rounds on ``issuer``, reserved
    now, which send something only for a bucket whose sum is not finite (see the module's
    note). ``buffer`` keeps its own values until the result is known, so that it can be sent
    again. ``polled``: the first round runs at a poll of this thread (a DDP bucket on a CPU,
    see :func:`commhooks.hooks._bucket.finished_by_polling`), not in the sum's callback.
    """
    # PyTorch's order (cast, then divide) keeps the results bitwise equal to its hooks'. On two
    # CPU ranks comm.allreduce sums the bucket by sending it to the other rank in chunks and
    # adding each as it arrives, with torch's kernels, where gloo's allreduce adds half
    # precision in scalar code: the same bits and bytes in about 0.6x of the time on loopback,
    # with 4 MiB of scratch space (gloo's allreduce takes 2 MiB).
    world = comm.size(group)
    low, flagged = _cast_down(buffer, dtype, world)
    repair = _Repair(buffer, world, issuer.group, owner, flagged)
    devices, hold = comm.follow_up_options(buffer, last_bucket)
    if not polled:  # the first round in the sum's own callback
        done = comm.allreduce_rounds(low, group, issuer, repair.rounds(), devices, hold)
    else:  # on this thread, at this bucket or a later one
        done = comm.allreduce_rounds(low, group, issuer, repair.rounds(), devices, polled=True)
        comm.poll(last_bucket)
    # ``done`` is completed by hand. A future derived from it with ``then`` fails as a real
    # error when a collective failed, which DDP reports with the backend's message; the hand-made
    # one would hold the exception as a value, which DDP then fails to read as a tensor.
    return comm.then(done, _value)


def average_held(
    dtype: torch.dtype,
    buffer: torch.Tensor,
    group: dist.ProcessGroup,
    last_bucket: bool,
    owner: str,
) -> "Future[torch.Tensor]":
    """:func:`average_in`'s counterpart on an accelerator (or in a GPU's branch on a CPU,
    :func:`commhooks._reads.as_on_a_gpu`): PyTorch's cast,
    division and collective, and the sum held with the step's others
    (:mod:`commhooks.hooks._held_sums`). What it needs of ``group`` besides is made at its
    first bucket and looked up once a bucket after (:class:`_HeldPath`): the issuer, its
    held sums, the world size, each hook's repair."""
    path = _HeldPath.of(group, owner)
    low = buffer.to(dtype, copy=True).div_(path.world)
    summed = comm.issue_allreduce(low, group)
    return path.held.file(buffer, summed, path.repairs[owner], last_bucket)


class _HeldPath:
    """What :func:`average_held` needs of one group: its follow-up issuer's held sums, its
    size, and for each hook the function that makes a bucket's repair rounds (called only for
    a sum that is not finite). Made at the group's first bucket: getting the issuer then
    creates the follow-up group (collective), at the same point on every rank."""

    # By the group's id, each path keeping a weak reference to its group: a plain dictionary
    # answers in a tenth of a weak-keyed one's host time, asked once a bucket. A path goes
    # when its group does (as the handshake's record of checked groups).
    _of: "dict[int, _HeldPath]" = {}

    def __init__(self, group: dist.ProcessGroup) -> None:
        issuer = comm.issuer_for(group)
        key = id(group)

        def forget(gone: "weakref.ref[dist.ProcessGroup]") -> None:
            # The id cannot be reused before this returns (the group is freed after).
            if key in _HeldPath._of and _HeldPath._of[key].group is gone:
                del _HeldPath._of[key]

        self.group = weakref.ref(group, forget)
        # The issuer, not its group: a path must not keep the group alive (the issuer of a
        # group whose follow-ups share it holds it weakly, see comm.IssuerPool).
        self.held, self.world, self.issuer = held_sums(issuer), comm.size(group), issuer
        self.repairs: dict[str, Callable[[torch.Tensor], Sequence[comm.Round]]] = {}

    @classmethod
    def of(cls, group: dist.ProcessGroup, owner: str) -> "_HeldPath":
        """The path of ``group``, with a repair for ``owner``'s buckets."""
        path = cls._of.get(id(group))
        if path is None or path.group() is not group:
            path = cls._of[id(group)] = cls(group)
        if owner not in path.repairs:
            world, issuer = path.world, path.issuer
            path.repairs[owner] = lambda buffer: _Repair(
                buffer, world, issuer.group, owner, flagged=False
            ).rounds()
        return path


def _value(fut: "Future[torch.Tensor]") -> torch.Tensor:
    return fut.value()


# On CPU what is summed is the bucket, a flag, then zeros up to a multiple of this many
# elements: gloo adds half precision slower when its chunks do not start aligned (an odd length
# cost about 5% more time per allreduce of 6M elements on two CPU ranks).
_SENT_MULTIPLE = 64
# Below this many elements a CPU bucket is cast and divided by PyTorch's two operations and its
# sum read afterwards, as on an accelerator: the flag's allocations and fused pass save a read
# of the sum, which costs less than their own calls on a small bucket (a 1,056-element bucket:
# 28 against 13 us to prepare on this machine, plus 5 us to read the sum).
_FLAGGED_FROM = 1 << 15


def _cast_down(buffer: torch.Tensor, dtype: torch.dtype, world: int) -> tuple[torch.Tensor, bool]:
    """What a rank sends: ``buffer`` cast to ``dtype`` and divided by ``world`` (on CPU, then a
    flag); and whether that flag decides if the summed bucket is finite.

    The flag, the element after the bucket, is 1 where this rank's reduced-precision values
    are not all finite and 0 otherwise, so that after the sum it counts the ranks holding inf
    or NaN. On one or two ranks that count decides whether the summed bucket is finite, with
    no pass over it: one rank adds nothing, and on two each value, halved, is at most half the
    dtype's largest, so their one rounded addition stays finite. With more ranks, partial sums
    are rounded one after another and may overflow although every value is finite: the flag
    is left 0 and the summed bucket is read instead (:func:`all_finite`). So it is for a
    small bucket (see ``_FLAGGED_FROM``). Only CPU buckets come here: on an accelerator the
    sums are checked together at the step's last bucket (one kernel queued with the rest;
    CUDA's unscaling kernel has no bfloat16, and the H100 showed no gain from the flag for
    float16), and so are CPU buckets that take a GPU's branch
    (:func:`commhooks._reads.as_on_a_gpu`, in tests).
    """
    if buffer.numel() < _FLAGGED_FROM:
        return buffer.to(dtype, copy=True).div_(world), False
    numel = buffer.numel()
    sent = -(-(numel + 1) // _SENT_MULTIPLE) * _SENT_MULTIPLE
    low = torch.empty(sent, dtype=dtype)
    values, rest = low[:numel], low[numel:]
    rest.zero_()
    nonfinite = _scale_down(buffer.reshape(-1), values, world)
    if world > 2:
        return low, False
    if nonfinite:  # zero already otherwise
        rest[:1].fill_(1.0)
    return low, True


def _scale_down(flat: torch.Tensor, values: torch.Tensor, world: int) -> bool:
    """Write ``flat`` cast to ``values``' dtype, then divided by ``world``, into ``values``;
    whether a cast value is infinite or NaN, where that is learnt on the way (else ``False``).

    bfloat16 takes one fused pass where the kernels are built (:mod:`commhooks.compress.cpu_kernels`).
    Otherwise the check rides on the division: PyTorch's unscaling kernel, its gradient
    scaler's, which multiplies by ``1 / world``, exact for one or two ranks, so the same bits
    as PyTorch's ``div_``. With more ranks the flag is not used and ``div_`` itself runs.
    """
    if values.dtype == torch.bfloat16:
        nonfinite = cpu_kernels.bfloat16_scaled(flat, values, world)
        if nonfinite is not None:
            return nonfinite
    values.copy_(flat)
    if world > 2:
        values.div_(world)
        return False
    found = torch.zeros(1, dtype=torch.float32)
    torch._amp_foreach_non_finite_check_and_unscale_([values], found, _INVERSE[world])
    return bool(found.item())


# ``1 / world`` for one and two ranks, as the unscaling kernel takes it: made once, read only.
_INVERSE = {world: torch.full((1,), 1.0 / world, dtype=torch.float32) for world in (1, 2)}


class _Repair:
    """What one bucket needs if its reduced-precision sum is not finite everywhere.

    Its two methods are follow-up rounds (:meth:`commhooks.comm.OrderedIssuer.rounds`): each runs
    on the thread that completed the collective before it (on an accelerator, on DDP's thread
    at the last bucket), in slot order, and issues at most one collective, on ``follow_up``.
    """

    def __init__(
        self,
        buffer: torch.Tensor,
        world: int,
        follow_up: dist.ProcessGroup | None,
        owner: str,
        flagged: bool,
    ) -> None:
        self.buffer, self.world, self.follow_up, self.owner = buffer, world, follow_up, owner
        self.flagged = flagged
        self.sums: torch.Tensor | None = None
        self.where: torch.Tensor | None = None

    def rounds(self) -> tuple[comm.Round, comm.Round]:
        """The two rounds, in order, for :meth:`commhooks.comm.OrderedIssuer.rounds`."""
        return (self.resend_overflowed, self.resend_bucket)

    def _finite(self, summed: torch.Tensor) -> bool:
        """Whether the summed bucket is all finite (see :func:`_cast_down`)."""
        numel = self.buffer.numel()
        if self.flagged:
            return float(summed[numel].item()) == 0.0
        return all_finite(summed[:numel])

    def _group(self) -> dist.ProcessGroup:
        if self.follow_up is None:
            raise RuntimeError(f"{self.owner}: its follow-up issuer has no process group.")
        return self.follow_up

    def resend_overflowed(self, summed: torch.Tensor) -> "comm.Finished[Any] | comm.Issue":
        """Cast a finite sum back; otherwise send its non-finite elements again, divided first."""
        numel = self.buffer.numel()
        finite, sums = self._finite(summed), summed[:numel]
        if finite:
            self.buffer.copy_(sums)
            comm.used_on_current_stream([summed])  # made on DDP's stream, read here
            # Finished with the buffer: the future then records the copy's stream, which the
            # next step (on another callback stream, with gloo) waits for.
            return comm.Finished(self.buffer)
        self.sums = sums
        self.where = torch.isfinite(sums).logical_not_().nonzero().view(-1)
        part = self.buffer[self.where]
        again = divide_overflowed_first(part, part.to(sums.dtype), self.world)
        group = self._group()
        return comm.Issue(lambda: comm.allreduce(again, group))

    def resend_bucket(self, again: torch.Tensor | None) -> "comm.Finished[Any] | comm.Issue":
        """Finish with the elements sent again if finite; otherwise average in full precision."""
        sums, where = self.sums, self.where
        self.sums = self.where = None  # the tensors are not needed past this step
        if sums is None or where is None:
            raise RuntimeError(f"{self.owner}: a bucket's second round ran without its first.")
        if again is not None and all_finite(again):
            sums[where] = again
            self.buffer.copy_(sums)
            comm.used_on_current_stream([sums, again])  # made on other streams, read here
            return comm.Finished(self.buffer)
        owner, dtype, buffer, group = self.owner, sums.dtype, self.buffer, self._group()
        return comm.Issue(
            lambda: comm.then(
                comm.average(buffer, group),
                lambda fut: _warn_if_overflowed(fut.value(), owner, dtype),
            )
        )


def divide_overflowed_first(buffer: torch.Tensor, low: torch.Tensor, world: int) -> torch.Tensor:
    """``low / world``, except where ``low`` is infinite: there ``buffer / world``, then cast.

    Where ``low`` is infinite, ``buffer`` was either too large for ``low``'s dtype (divided
    first, it may fit) or infinite itself (divided first, it stays the same infinity). Every
    other element keeps PyTorch's arithmetic, NaN included.
    """
    early = torch.div(buffer, world, out=torch.empty_like(low))
    return torch.where(torch.isinf(low), early, low.div_(world))


def _warn_if_overflowed(averaged: torch.Tensor, owner: str, dtype: torch.dtype) -> torch.Tensor:
    # A finite full-precision average means every rank's gradient was finite: the overflow was
    # the reduced precision's. Otherwise the gradient itself was inf/NaN, which is no news here.
    if all_finite(averaged):
        advice = " or use bf16" if dtype == torch.float16 else ""
        warn_once(
            f"{owner}-overflow",
            f"{owner}: a bucket's average, summed in {dtype}, went beyond its range "
            f"(+-{torch.finfo(dtype).max:g}) although every gradient was finite, so that bucket "
            f"was re-sent in {averaged.dtype}. If this repeats, scale the loss down{advice}.",
        )
    return averaged


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element of ``tensor`` is finite, copying nothing.

    A sum is infinite or NaN whenever an element is (additions carry both through), and it
    reads a half-precision tensor about twice as fast as a minimum/maximum does on CPU. Its
    total can overflow the dtype although every element is finite: only then are the minimum
    and maximum read as well, which are non-finite exactly when an element is. Reading the
    result back makes the host wait for an accelerator.
    """
    if tensor.numel() == 0:
        return True
    if math.isfinite(tensor.sum().item()):
        return True
    low, high = torch.aminmax(tensor)
    return math.isfinite(low.item()) and math.isfinite(high.item())


def saturating_cast(buffer: torch.Tensor, dtype: torch.dtype, owner: str) -> torch.Tensor:
    """``buffer`` cast to ``dtype``, finite values beyond float16's range clipped to it.

    Infinite and NaN gradients stay what they are. On CPU a clip is reported with a warning;
    on an accelerator the clip is applied on the device without one (counting would make the
    host wait for the device at every bucket): three more passes, with a boolean mask.
    """
    low = buffer.to(dtype)
    # bfloat16 has float32's range; a float16 bucket has nothing beyond it, and ``low`` is the
    # bucket itself, whose own infinities a clip would turn into +-65504 for good.
    if dtype != torch.float16 or buffer.dtype == dtype:
        return low
    if _reads.are_free(low):
        if all_finite(low):
            return low
        clipped = int((torch.isinf(low) & torch.isfinite(buffer)).sum())
        if clipped:
            warn_once(
                f"{owner}-clip",
                f"{owner}: {clipped} gradient values exceed the float16 range and were clipped "
                f"to +-{torch.finfo(dtype).max:g}. Scale the loss down or use "
                "bf16_compress_wrapper.",
            )
    limit = torch.finfo(dtype).max
    low.clamp_(-limit, limit)  # every infinity, overflowed or not, becomes +-limit
    # The gradient's own infinities come back; one boolean mask alive at a time.
    low.masked_fill_(torch.isposinf(buffer), math.inf)
    return low.masked_fill_(torch.isneginf(buffer), -math.inf)
