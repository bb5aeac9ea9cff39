"""PowerSGD's default step on a bucket: two rounds of communication, ``P`` then ``Q``.

With one bucket all of this runs after backward, on the critical path of the step, so passes
over the gradients are fused where that is faster: the reconstruction and the new error in one
blocked pass (:func:`commhooks.compress.lowrank.reconstruct_`). Three passes in all: compensate and
multiply, multiply, and write both the approximation and the new error.

Hook modules must not use ``from __future__ import annotations``: DDP rejects string annotations.
"""

import torch

from commhooks import comm

from . import stages
from .stages import BucketStep

__all__ = ["two_rounds"]

Future = torch.futures.Future


def two_rounds(step: BucketStep) -> "Future[torch.Tensor]":
    """One power iteration per matrix ``M`` (gradient plus remembered error), as in the paper.

    ``Q`` is the last step's (warm start) or random, orthogonal; ``P = M Q``, summed over the
    ranks and orthogonalised; ``Q = Mᵀ P``, averaged; ``M ≈ P Qᵀ``, and ``M - P Qᵀ`` is
    remembered. The tensors sent as they are (vectors, small matrices) are averaged with the
    first round. The first round is issued here, on DDP's thread. The second follows it
    whatever its result, and only then is it decided whether the step was finite (see
    :func:`_second_round`): where collectives complete as they are queued (NCCL's; comm gives
    the issuer the hook's own group only there), at once, on DDP's thread, so that ``Q``'s sum
    overlaps the rest of the backward pass as ``P``'s does; elsewhere in the state's issuer,
    in slot order. The decision takes the next slot.
    """
    group = step.group
    world = comm.size(group)
    packed = stages.compensate(step)  # M = gradient + remembered error
    # The uncompressed tensors need no compression work: their average starts first.
    # PyTorch's order (sum, then divide) rather than DDP's, for the same numerics as its hook.
    plain = (
        comm.allreduce_then(packed, group, lambda summed: summed.div_(world))
        if packed.numel()
        else comm.completed(packed)
    )
    q, p = stages.first_factors(step, single=False)  # P = M Q
    # P is orthogonalised after the sum, so it needs no division by the world size.
    p_sum = comm.allreduce(p, group)
    firsts = torch.futures.collect_all([plain, p_sum])
    issuer = step.state.issuer
    if issuer.group is group:
        q_sum = _second_round(step, firsts.wait(), packed, p, q)
    else:
        options = comm.follow_up_options(step.buffer, step.bucket.is_last())
        q_sum = issuer.then(firsts, lambda done: _second_round(step, done, packed, p, q), *options)
    return step.follow_up(q_sum, lambda summed: _decide(step, packed, summed))


def _second_round(
    step: BucketStep,
    firsts: "list[Future[torch.Tensor]]",
    packed: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor,
) -> "Future[torch.Tensor]":
    """From the summed ``P``: its finiteness check started (:meth:`BucketStep.queue_check`), then
    ``Q = Mᵀ P`` (:func:`stages.project`, which touches neither the bucket nor the memory) and
    its sum, issued whether ``P`` was finite or not: a step that was not finite sends a ``Q``
    for nothing and then falls back (:func:`_decide`)."""
    for first in firsts:
        # Re-raises a failed collective; on a GPU, also makes this stream wait for its result
        # (the list gathering them knows no streams).
        first.wait()
    step.queue_check(packed, p)
    stages.project(step, q)
    return comm.allreduce(q, step.state.issuer.group)


def _decide(step: BucketStep, packed: torch.Tensor, q: torch.Tensor) -> "Future[torch.Tensor]":
    """In the issuer's slot, with ``Q`` summed: fall back if the first round was not finite;
    else the vectors take their average, ``M ≈ P Qᵀ`` into the gradients and ``M - P Qᵀ`` into
    the memory, ``Q`` kept."""
    if not step.finite():
        return stages.fall_back(step)
    stages.take_vectors(step, packed)
    q.div_(comm.size(step.group))
    stages.approximate(step, q)
    return comm.completed(step.write_back())
