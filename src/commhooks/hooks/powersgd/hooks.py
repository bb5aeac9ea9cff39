"""The PowerSGD hooks: check, number the bucket's parameters, plan, and run a pipeline.

``powerSGD_hook`` averages each large gradient matrix of a bucket as rank-``r`` factors ``P``
(n x r) and ``Q`` (m x r), the rest as it is; ``batched_powerSGD_hook`` treats the whole bucket
as one zero-padded square matrix. The numerics of the default options are PyTorch's; unlike
its hooks of the same names:

* State is kept per parameter, so DDP's bucket rebuild, a restart or another ``bucket_cap_mb``
  never applies one layer's error to another.
* The ``Q`` round goes through the state's :class:`~commhooks.comm.OrderedIssuer`, so ranks
  issue the same collectives in the same order whatever the thread timing: many buckets work
  on gloo.
* The uncompressed tensors travel with ``P``; no device-wide synchronisation; the error is
  added in place instead of cloning the bucket.

A hook uses only the bucket's methods (``index``, ``buffer``, ``gradients``, ``parameters``,
``is_last``): any object that has them can stand for DDP's ``GradBucket``.

Hook modules must not use ``from __future__ import annotations``: DDP rejects string annotations.
"""

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from commhooks import comm
from commhooks.compress import lowrank
from commhooks.compress.error_feedback import Key
from commhooks.compress.factors import BOTH, P_STEP
from commhooks.hooks._bucket import float_buffer
from commhooks.hooks.repair import REPAIR, repaired

from .codec import BATCHED, LAYERWISE
from .plan import Plan
from .state import PowerSGDState
from .step import BucketStep, Layout, Matrix, lay_out, one_round, two_rounds

__all__ = ["batched_powerSGD_hook", "powerSGD_hook", "state_maker"]

Future = torch.futures.Future


def powerSGD_hook(
    state: PowerSGDState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with each large gradient matrix compressed to rank-``r`` factors.

    Plain allreduce for the first ``state.start_powerSGD_iter`` steps. Then each matrix ``M``
    (plus its remembered error) is approximated by ``P Qᵀ`` with one power iteration
    (``P = M Q``, sum, orthogonalise, ``Q = Mᵀ P``, average) and ``M - P Qᵀ`` remembered; the
    other tensors are averaged with ``P``.

    Args:
        state: the :class:`PowerSGDState` with the options and memory.
        bucket: the gradient bucket DDP hands to the hook.

    Raises:
        TypeError: ``state`` is not a :class:`PowerSGDState`, or the bucket is not a dense
            floating-point one.
        StateDictError: ``state`` belongs to :func:`batched_powerSGD_hook`.
    """
    state, group = _begin(state, bucket, LAYERWISE)
    return state.buckets.average(bucket, state.number, lambda b: _layerwise_step(state, b, group))


def _layerwise_step(
    state: PowerSGDState, bucket: dist.GradBucket, group: dist.ProcessGroup
) -> "Future[torch.Tensor]":
    """:func:`powerSGD_hook`'s step on one bucket (DDP's, or one of the saved buckets DDP's are
    cut into after a load: :class:`~commhooks.hooks.buckets.SavedBuckets`)."""
    buffer, numbers = bucket.buffer(), state.number(bucket.parameters())
    if not state.compressing():  # plain allreduce, before compression starts
        state.maybe_increase_iter(bucket)
        return comm.average(buffer, group)
    plan = state.plan(numbers, bucket.gradients)
    single = state.settings.single_round
    steps = tuple(state.factors.next_step(c[1]) for c in plan.compressed) if single else ()
    signature = (buffer.data_ptr(), numbers, steps)
    layout = state.layout(bucket.index(), signature)
    if layout is None:
        layout = state.keep_layout(bucket.index(), _layerwise(state, bucket, plan, signature))
    # A single-round step sends one factor: P (n x r) or Q (m x r), not both.
    idle = sum(_idle_factor(m) for b in layout.batches for m in b.matrices) if single else 0
    state.count_elements(plan.numel_before, plan.numel_after - idle, bucket)
    return _run(BucketStep(state, bucket, buffer, group, layout))


def batched_powerSGD_hook(
    state: PowerSGDState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket compressed as one zero-padded square matrix of rank-``r`` factors.

    Cheaper than :func:`powerSGD_hook` (one product per bucket) but far less accurate unless
    the rank is 1: a flat bucket has no low-rank structure across layers. State is kept per
    bucket, reset (with a warning) when DDP rebuilds the bucket with other parameters; after a
    load, DDP's first buckets are cut as the saved run's were, so they meet their state.
    Raises as :func:`powerSGD_hook` does.
    """
    state, group = _begin(state, bucket, BATCHED)
    return state.buckets.average(bucket, state.number, lambda b: _batched_step(state, b, group))


def _batched_step(
    state: PowerSGDState, bucket: dist.GradBucket, group: dist.ProcessGroup
) -> "Future[torch.Tensor]":
    """:func:`batched_powerSGD_hook`'s step on one bucket, as :func:`_layerwise_step`."""
    buffer, numbers = bucket.buffer(), state.number(bucket.parameters())
    if not state.compressing():  # plain allreduce, before compression starts
        state.maybe_increase_iter(bucket)
        return comm.average(buffer, group)
    key = f"bucket{bucket.index()}"
    order = state.bucket_order(key, numbers)
    length = buffer.numel()
    side = lowrank.square_side(length)
    rank = lowrank.effective_rank(side, side, state.settings.matrix_approximation_rank)
    single = state.settings.single_round
    state.count_elements(length, (1 if single else 2) * side * rank, bucket)
    # The bucket stays as it was until the result is written back: the error is added to the
    # padded copy, which the layout keeps from step to step.
    step_of = state.factors.next_step(key) if single else BOTH
    signature = (buffer.data_ptr(), numbers, step_of)
    layout = state.layout(bucket.index(), signature)
    if layout is None:
        square = buffer.new_zeros(side, side)
        matrix = Matrix(key, square, rank, step_of)
        layout = state.keep_layout(bucket.index(), lay_out(signature, [matrix], [], [], False))
    square = layout.batches[0].matrices[0].view.view(-1)
    if length < square.numel():  # the padding of the last step's approximation
        square[length:].zero_()
    writeback = _gather(bucket, buffer, square[:length], order)
    step = BucketStep(state, bucket, buffer, group, layout, writeback)
    return _run(step)


def state_maker(
    hook: Callable[..., Any],
) -> Callable[[dist.ProcessGroup | None, Mapping[str, Any]], PowerSGDState]:
    """How :func:`commhooks.register` builds the state of ``hook``, which knows its hook from
    the start: a state dict of the other hook is refused at load, not at the first step."""

    def make(group: dist.ProcessGroup | None, options: Mapping[str, Any]) -> PowerSGDState:
        state = PowerSGDState(group, **options)
        state.hook_name = hook.__name__
        return state

    return make


def _begin(
    state: Any, bucket: dist.GradBucket, hook: str
) -> tuple[PowerSGDState, dist.ProcessGroup]:
    """What both hooks do first, before any collective: check their arguments, get the group."""
    if not isinstance(state, PowerSGDState):
        raise TypeError(
            f"{hook} needs a commhooks.PowerSGDState as its state, got {type(state).__name__}. "
            f"Register it as ddp_model.register_comm_hook(PowerSGDState(None, ...), {hook})."
        )
    float_buffer(bucket, hook)  # refuses a sparse gradient, naming the hooks to use
    return state, state.prepare(hook)


def _run(step: BucketStep) -> "Future[torch.Tensor]":
    """Issue the bucket's pipeline; the step counts once the last bucket's is under way."""
    pipeline = one_round if step.state.settings.single_round else two_rounds
    if step.state.settings.on_nonfinite == REPAIR:
        name = step.state.hook_name or "PowerSGD"
        done = repaired(REPAIR, step.bucket, step.group, name, lambda: pipeline(step))
    else:
        done = pipeline(step)
    step.state.maybe_increase_iter(step.bucket)
    return done


def _layerwise(state: PowerSGDState, bucket: Any, plan: Plan, signature: tuple[Any, ...]) -> Layout:
    """A bucket's matrices and vectors as views of its gradients, batched as the options say."""
    grads, numbers = bucket.gradients(), signature[1]
    steps = signature[2] or (BOTH,) * len(plan.compressed)
    matrices = [
        Matrix(number, grads[i].view(n, m), r, step)
        for (i, number, n, m, r), step in zip(plan.compressed, steps)
    ]
    vectors = [grads[i] for i in plan.uncompressed]
    keys: list[Key] = [numbers[i] for i in plan.uncompressed]
    together = state.settings.batch_tensors_with_same_shape
    return lay_out(signature, matrices, vectors, keys, together)


def _idle_factor(m: Matrix) -> int:
    """Elements of the factor a single-round step does not send: ``Q`` on a P step, or ``P``."""
    n, cols = m.view.shape
    return (cols if m.step == P_STEP else n) * m.rank


def _gather(
    bucket: dist.GradBucket, buffer: torch.Tensor, flat: torch.Tensor, order: list[int] | None
) -> Callable[[], object]:
    """Copy the bucket into ``flat`` in the state's order; return what copies the result back."""
    if order is None:
        flat.copy_(buffer)
        return functools.partial(buffer.copy_, flat)
    # The same parameters in another order: laid out as the state expects them.
    grads = bucket.gradients()
    pieces = [grads[i].reshape(-1) for i in order]
    lowrank.pack_into(pieces, flat)
    return functools.partial(lowrank.unpack_from, flat, pieces)
