"""PowerSGD's single-round step on a bucket: one factor per matrix, one collective.

Each step refines one factor of each matrix, alternately ``P = M Q`` (from the last ``Q``) and
``Q = Mᵀ P`` (from the last ``P``), and sends it packed with the tensors sent as they are. A
matrix compressed on its own never has its memory added to the gradient: the gradient is added
into the memory, and the factor formed, in one pass before the collective
(:meth:`~commhooks.error_feedback.LazyErrorFeedback.absorb_`); after the collective one pass writes
``P Qᵀ`` into the gradient, and the memory keeps ``P Qᵀ`` to subtract later.

Hook modules must not use ``from __future__ import annotations``: DDP rejects string annotations.
"""

import torch

from commhooks import callbacks, comm, lowrank

from . import stages
from .stages import Batch, BucketStep, Matrix

__all__ = ["one_round"]

Future = torch.futures.Future


def one_round(step: BucketStep) -> "Future[torch.Tensor]":
    """Send one factor of each matrix ``M`` (gradient plus remembered error), then ``M ≈ P Qᵀ``.

    The collective is issued here, on DDP's thread; the check of its result in the state's
    issuer, in slot order, since a result that is not finite sends the bucket again.
    """
    stages.compensate_vectors(step)
    together = stages.kinds(step)
    for matrices in together:
        if len(matrices) > 1:
            stages.compensate_matrices(step, matrices)  # stacking copies M: it must be formed first
    stages.form_batches(step, together)
    known = stages.lay_out_known(step)
    unc = step.vector_numel()
    send = step.new_flat(unc + stages.sent_numel(step))
    lowrank.pack_into(step.vectors, send[:unc])
    stages.lay_out_sent(step, send[unc:])
    stages.start_factors(step, known)  # the last step's other factor, orthogonalised
    for batch in step.batches:
        if batch.stacked:
            stages.sent_factor(step, batch)
        else:
            _absorb(step, batch)
    averaged = comm.average(send, step.group)
    checked = step.follow_up(averaged, lambda result: _unless_finite(step, result))
    return callbacks.then(checked, lambda done: _approximate(step, done, unc))


def _absorb(step: BucketStep, b: Batch) -> None:
    """A matrix on its own: its factor, of the memory with the gradient added in (one pass)."""
    m = b.matrices[0]
    if not step.state.settings.use_error_feedback:
        stages.sent_factor(step, b)
        return
    memory = step.state.memory
    m.absorbed = memory.absorb_(m.key, m.view, b.known[0], b.sent[0], b.refines_q, step.scratch())


def _unless_finite(step: BucketStep, averaged: torch.Tensor) -> "Future[torch.Tensor | None]":
    """The averaged factors; or, if they are not finite, ``None`` once the bucket was sent again.

    Every rank sees the same result, so every rank then does what the two-round variant does
    after its first round (:func:`~.step.fall_back`): a second collective on that step only.
    """
    if lowrank.is_finite(averaged):
        return comm.completed(averaged)
    return callbacks.then(stages.fall_back(step), _nothing)


def _nothing(sent: "Future[torch.Tensor]") -> None:
    sent.wait()  # re-raises a failed collective


def _approximate(step: BucketStep, done: "Future[torch.Tensor | None]", unc: int) -> torch.Tensor:
    """``M ≈ P Qᵀ`` into the gradients; keep both factors and the step each matrix made."""
    averaged = done.wait()
    if averaged is None:  # sent again as plain allreduce would: the bucket holds its average
        return step.buffer
    stages.unpack_vectors(step, averaged[:unc])
    for b in step.batches:
        p, q = (b.known, b.sent) if b.refines_q else (b.sent, b.known)
        if b.stacked:
            stages.decompress(step, b, p, q)
        else:
            _write_alone(step, b.matrices[0], p[0], q[0].t())
        for i, m in enumerate(b.matrices):
            step.state.factors.keep(m.key, p[i].clone(), q[i].clone(), m.step)
    return step.write_back()


def _write_alone(step: BucketStep, m: Matrix, p: torch.Tensor, qt: torch.Tensor) -> None:
    """The gradient becomes ``P Qᵀ``, which joins the products pending on the memory."""
    if m.absorbed is not None:
        step.state.memory.defer_(m.key, p, qt)
    lowrank.product_into(m.view, p, qt)
