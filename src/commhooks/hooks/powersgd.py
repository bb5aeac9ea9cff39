"""PowerSGD: low-rank gradient compression with error feedback and warm start.

``powerSGD_hook`` compresses each gradient matrix of a bucket to rank-``r`` factors ``P`` (n x r)
and ``Q`` (m x r) and averages those instead of the matrix; vectors and matrices too small to
gain are averaged as they are. ``batched_powerSGD_hook`` treats the whole bucket as one
zero-padded square matrix. Both take a :class:`PowerSGDState`.

How this differs from PyTorch's hooks of the same names (the numerics of the default options
are the same):

* State is kept per parameter, not per bucket, so DDP's bucket rebuild after the first step,
  a restart, or another ``bucket_cap_mb`` can never apply one layer's error to another layer;
  ``start_powerSGD_iter`` may therefore be 0 or 1.
* First-round collectives are issued on DDP's thread, in bucket order; the ``Q`` round, which
  needs ``P``'s result, goes through :func:`commhooks.comm.issuer_for` to a follow-up group of
  its own, in the order its slots were reserved. Ranks therefore issue the same collectives in
  the same order on each group whatever the thread timing: many buckets work on gloo.
* The uncompressed tensors' allreduce starts before the compression work, together with the
  ``P`` round, instead of before it; no device-wide synchronisation; error feedback adds the
  remembered error into the gradient in place instead of cloning the bucket. Like PyTorch, it
  also remembers ``local - mean`` for the tensors sent uncompressed (small, and keeping it makes
  the numerics PyTorch's to the last bit where the order of operations allows).
* ``single_round=True`` sends one collective per bucket per step (see :class:`PowerSGDState`).

Hook modules must not use ``from __future__ import annotations``: DDP rejects string annotations.
"""

import functools
from typing import Any

import torch
import torch.distributed as dist

from commhooks import comm, lowrank
from commhooks.hooks._bucket import float_buffer
from commhooks.hooks._powersgd_rounds import _Call, _Entry, run, single_round_step
from commhooks.hooks._powersgd_state import _BOTH, _P_STEP, PowerSGDState
from commhooks.hooks._powersgd_state import OPTION_NAMES as OPTION_NAMES  # used by config

__all__ = ["PowerSGDState", "batched_powerSGD_hook", "powerSGD_hook"]


# ----------------------------------------------------------------------------------------------
# The hooks
# ----------------------------------------------------------------------------------------------
def _check_state(state: Any, owner: str) -> PowerSGDState:
    if not isinstance(state, PowerSGDState):
        raise TypeError(
            f"{owner} needs a commhooks.PowerSGDState as its state, got {type(state).__name__}. "
            f"Register it as ddp_model.register_comm_hook(PowerSGDState(None, ...), {owner})."
        )
    return state


def powerSGD_hook(
    state: PowerSGDState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with each large gradient matrix compressed to rank-``r`` factors.

    Plain allreduce for the first ``state.start_powerSGD_iter`` steps. Then, per bucket: the
    uncompressed tensors (vectors, small matrices) are packed and their average started; each
    other gradient ``M`` (plus its remembered error) is approximated by ``P Qᵀ`` with one power
    iteration: ``P = M Q``, sum ``P``, orthogonalise, ``Q = Mᵀ P``, average ``Q``. The error
    ``M - P Qᵀ`` is remembered. With ``state.single_round``, one factor per step and one
    collective (see :class:`PowerSGDState`).

    Args:
        state: the :class:`PowerSGDState` with the options and memory.
        bucket: the gradient bucket DDP hands to the hook.
    """
    state, buffer, group, ordinals, warmup = _begin(state, bucket, "powerSGD_hook")
    if warmup is not None:
        return warmup
    grads = bucket.gradients()
    plan = state._plan(ordinals, grads)
    entries = []
    for i, ordinal, n, m, r in plan.compressed:
        step = single_round_step(state, ordinal) if state.single_round else _BOTH
        entries.append(_Entry(ordinal, grads[i].view(n, m), r, step))
    after = plan.numel_after
    if state.single_round:  # one factor a step: P (n x r) or Q (m x r), not both
        after -= sum(_idle_factor(e) for e in entries)
    state._count(plan.numel_before, after, bucket)
    call = _Call(
        state,
        bucket,
        buffer,
        group,
        entries,
        [grads[i] for i in plan.uncompressed],
        [ordinals[i] for i in plan.uncompressed],
    )
    return run(call)


def batched_powerSGD_hook(
    state: PowerSGDState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket compressed as one zero-padded square matrix of rank-``r`` factors.

    Cheaper than :func:`powerSGD_hook` (one product per bucket) but far less accurate unless
    the rank is 1, since a flat bucket has no low-rank structure across layers. State is kept
    per bucket and reset (with a warning) when DDP rebuilds the bucket with other parameters.

    Args:
        state: the :class:`PowerSGDState` with the options and memory.
        bucket: the gradient bucket DDP hands to the hook.
    """
    state, buffer, group, ordinals, warmup = _begin(state, bucket, "batched_powerSGD_hook")
    if warmup is not None:
        return warmup
    key = f"bucket{bucket.index()}"
    order = state._bucket_order(key, ordinals)
    length = buffer.numel()
    side = lowrank.square_side(length)
    rank = lowrank.effective_rank(side, side, state.matrix_approximation_rank)
    state._count(length, (1 if state.single_round else 2) * side * rank, bucket)
    # The bucket stays as it was until the result is written back: the error is added to the
    # padded copy, so a fallback to plain allreduce sends the untouched gradient.
    square = torch.zeros(side * side, dtype=buffer.dtype, device=buffer.device)
    flat = square[:length]
    if order is None:
        flat.copy_(buffer)
        writeback = functools.partial(buffer.copy_, flat)
    else:  # the same parameters in another order: laid out as the state expects them
        grads = bucket.gradients()
        pieces = [grads[i].reshape(-1) for i in order]
        lowrank.pack_into(pieces, flat)
        writeback = functools.partial(lowrank.unpack_from, flat, pieces)
    step = single_round_step(state, key) if state.single_round else _BOTH
    entry = _Entry(key, square.view(side, side), rank, step)
    call = _Call(state, bucket, buffer, group, [entry], [])
    call.writeback = writeback
    return run(call)


def _idle_factor(e: _Entry) -> int:
    """Elements of the factor a single-round step does not send: ``Q`` on a P step, or ``P``."""
    n, m = e.matrix.shape
    return (m if e.step == _P_STEP else n) * e.rank


def _begin(state: Any, bucket: dist.GradBucket, owner: str) -> tuple:
    """What both hooks do first: check their arguments, then average plainly while warming up.

    Returns ``(state, buffer, group, ordinals, warmup)``, where ``warmup`` is the future of the
    plain allreduce before compression starts and ``None`` once it has.
    """
    state = _check_state(state, owner)
    buffer = float_buffer(bucket, owner)
    group = state._group(owner)
    ordinals = state._ordinals_of(bucket.parameters())
    if state._compressing():
        return state, buffer, group, ordinals, None
    state.maybe_increase_iter(bucket)
    return state, buffer, group, ordinals, comm.average(buffer, group)
