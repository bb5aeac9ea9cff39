"""PowerSGD's single-round step on a bucket: one factor per matrix, one collective.

Each step refines one factor of each matrix, alternately ``P = M Q`` (from the last ``Q``) and
``Q = Mᵀ P`` (from the last ``P``), and sends it packed with the tensors sent as they are. A
matrix compressed on its own never has its memory added to the gradient: the gradient is added
into the memory, and the factor formed, in one pass before the collective
(:meth:`~commhooks.compress.error_feedback.LazyErrorFeedback.absorb_`); after the collective one pass writes
``P Qᵀ`` into the gradient, and the memory keeps ``P Qᵀ`` to subtract later (a small matrix's
is subtracted at once, with the bucket's other small ones).

Hook modules must not use ``from __future__ import annotations``: DDP rejects string annotations.
"""

import torch

from commhooks import comm, finiteness

from . import stages
from .stages import BucketStep

__all__ = ["one_round"]

Future = torch.futures.Future


def one_round(step: BucketStep) -> "Future[torch.Tensor]":
    """Send one factor of each matrix ``M`` (gradient plus remembered error), then ``M ≈ P Qᵀ``.

    The collective is issued here, on DDP's thread; the check of its result in the state's
    issuer, in slot order, since a result that is not finite sends the bucket again.
    """
    unc = step.vector_numel()
    _, send = stages.first_factors(step, single=True)  # compensated, then factors
    averaged = comm.average(send, step.group)
    if finiteness.queues(send):  # on a GPU: the check held with the step's others
        averaged = comm.then(averaged, lambda done: _queue_check(step, done))
    checked = step.follow_up(averaged, lambda result: _unless_finite(step, result))
    return comm.then(checked, lambda done: _approximate(step, done, unc))


def _queue_check(step: BucketStep, done: "Future[torch.Tensor]") -> torch.Tensor:
    averaged = done.wait()
    step.queue_check(averaged)
    return averaged


def _unless_finite(step: BucketStep, averaged: torch.Tensor) -> "Future[torch.Tensor | None]":
    """The averaged factors; or, if they are not finite, ``None`` once the bucket was sent again.

    Every rank sees the same result, so every rank then does what the two-round variant does
    after its first round (:func:`~.stages.fall_back`): a second collective on that step only.
    """
    if step.finite(averaged):
        return comm.completed(averaged)
    sent = stages.fall_back(step)
    return comm.then(sent, _nothing)


def _nothing(sent: "Future[torch.Tensor]") -> None:
    sent.wait()  # re-raises a failed collective


def _approximate(step: BucketStep, done: "Future[torch.Tensor | None]", unc: int) -> torch.Tensor:
    """``M ≈ P Qᵀ`` into the gradients; keep both factors and the step each matrix made."""
    averaged = done.wait()
    if averaged is None:  # sent again as plain allreduce would: the bucket holds its average
        return step.buffer
    stages.finish_single(step, averaged[:unc])
    return step.write_back()
