"""PowerSGD's default step on a bucket: two rounds of communication, ``P`` then ``Q``.

With one bucket all of this runs after backward, on the critical path of the step, so passes
over the gradients are fused where that is faster: the reconstruction and the new error in one
blocked pass (:func:`commhooks.lowrank.reconstruct_`). Three passes in all: compensate and
multiply, multiply, and write both the approximation and the new error.

Hook modules must not use ``from __future__ import annotations``: DDP rejects string annotations.
"""

import torch

from commhooks import callbacks, comm

from . import stages
from .stages import BucketStep

__all__ = ["two_rounds"]

Future = torch.futures.Future


def two_rounds(step: BucketStep) -> "Future[torch.Tensor]":
    """One power iteration per matrix ``M`` (gradient plus remembered error), as in the paper.

    ``Q`` is the last step's (warm start) or random, orthogonal; ``P = M Q``, summed over the
    ranks and orthogonalised; ``Q = Mᵀ P``, averaged; ``M ≈ P Qᵀ``, and ``M - P Qᵀ`` is
    remembered. The tensors sent as they are (vectors, small matrices) are averaged with the
    first round. The first round is issued here, on DDP's thread; the second in the state's
    issuer, in slot order.
    """
    group = step.group
    world = group.size()
    packed = stages.compensate(step)  # M = gradient + remembered error
    # The uncompressed tensors need no compression work: their average starts first.
    # PyTorch's order (sum, then divide) rather than DDP's, for the same numerics as its hook.
    plain = (
        callbacks.then(comm.allreduce(packed, group), lambda fut: fut.value().div_(world))
        if packed.numel()
        else comm.completed(packed)
    )
    q, p = stages.first_factors(step, single=False)  # P = M Q
    # P is orthogonalised after the sum, so it needs no division by the world size.
    p_sum = comm.allreduce(p, group)
    firsts = torch.futures.collect_all([plain, p_sum])
    if step.state.issuer.group is group:
        return _second_round_at_once(step, firsts, packed, p, q)
    return step.follow_up(firsts, lambda done: _second_round(step, done, packed, p, q), (packed, p))


def _second_round_at_once(
    step: BucketStep,
    firsts: "Future[list[Future[torch.Tensor]]]",
    packed: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor,
) -> "Future[torch.Tensor]":
    """The second round on DDP's thread, right after the first: where collectives complete as
    they are queued (NCCL's; comm gives the issuer the hook's own group only there), ``P``'s
    sum is ready, so ``Q = Mᵀ P`` and its sum are queued at once, in bucket order, and overlap
    the rest of the backward pass as the first round does. The check of ``P`` is queued before
    ``P`` is orthogonalised; only the decision waits for its turn (the step's last bucket, on a
    GPU): a step that was not finite sent a ``Q`` for nothing and falls back, the bucket and the
    memory untouched until then.
    """
    for first in firsts.wait():
        first.wait()  # re-raises a failed collective; this stream waits for its result
    step.queue_check(packed, p)
    starts = stages.project(step, q)
    q_sum = comm.allreduce(q, step.group)
    return step.follow_up(q_sum, lambda summed: _decide(step, packed, summed, starts))


def _decide(
    step: BucketStep, packed: torch.Tensor, q: torch.Tensor, starts: torch.Tensor | None
) -> "Future[torch.Tensor]":
    """In the issuer's slot, with ``Q`` summed: fall back if the first round was not finite,
    else finish as :func:`_approximate` does."""
    if not step.finite():
        return stages.fall_back(step)
    stages.take_vectors(step, packed)
    q.div_(step.group.size())
    stages.approximate(step, q, starts)
    return comm.completed(step.write_back())


def _second_round(
    step: BucketStep,
    firsts: "list[Future[torch.Tensor]]",
    packed: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor,
) -> "Future[torch.Tensor]":
    """From the summed ``P``: ``Q = Mᵀ P``, averaged, then ``M ≈ P Qᵀ``; in the issuer's slot."""
    for first in firsts:
        # Re-raises a failed collective; on a GPU, also makes this stream wait for its result
        # (the list gathering them knows no streams).
        first.wait()
    if not step.finite(packed, p):  # reduced data: every rank decides alike
        return stages.fall_back(step)
    starts = stages.second_factors(step, packed, q)  # Q = Mᵀ P over the starting Q
    q_sum = comm.allreduce(q, step.state.issuer.group)
    return callbacks.then(q_sum, lambda done: _approximate(step, done, q, starts))


def _approximate(
    step: BucketStep,
    done: "Future[torch.Tensor]",
    q: torch.Tensor,
    starts: torch.Tensor | None,
) -> torch.Tensor:
    """``M ≈ P Qᵀ`` into the gradients, ``M - P Qᵀ`` into the memory; keep ``Q``."""
    done.wait()
    q.div_(step.group.size())
    stages.approximate(step, q, starts)
    return step.write_back()
