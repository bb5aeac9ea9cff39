"""Argument checks shared by the hooks, run before any collective is issued."""

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from commhooks import comm, handshake
from commhooks.state import StatelessState

if TYPE_CHECKING:  # torch.distributed does not re-export it to type checkers
    from torch._C._distributed_c10d import GradBucket as GradBucket
else:
    GradBucket = dist.GradBucket  # the very class DDP expects a hook's annotation to name

# What a hook that cannot take sparse gradients tells the user to use instead.
SPARSE_HOOKS = "commhooks.allreduce_hook, commhooks.post_localSGD_hook or commhooks.noop_hook"


# The process-group classes met so far (torch's, and subclasses such as a test's backend).
_GROUP_TYPES: set[type] = {dist.ProcessGroup}


def group_state(state: Any, owner: str) -> dist.ProcessGroup:
    """The group of a stateless hook's ``state``: a process group, ``None``, or the
    :class:`~commhooks.state.StatelessState` ``commhooks.register`` gives it; checked once by
    :mod:`commhooks.handshake`. ``TypeError`` for another hook's state."""
    policy = "propagate"
    if isinstance(state, StatelessState):
        state, policy = state.process_group, state.on_nonfinite
    # The usual cases first, without resolve_group's checks: they cannot fail for a group that
    # exists (a GPU's host pays every call here once a bucket, while the device waits).
    if state is None:
        state = dist.group.WORLD  # None if torch.distributed is not initialised: checked below
    # The type first: ``isinstance`` on torch's group class takes a Python-level check
    # (about 0.2 us a bucket, 0.5 for a subclass).
    if type(state) in _GROUP_TYPES:
        known: dist.ProcessGroup = state
        handshake.once(known, owner, policy)
        return known
    if isinstance(state, dist.ProcessGroup):
        _GROUP_TYPES.add(type(state))
        handshake.once(state, owner, policy)
        return state
    if state is not None and not isinstance(state, int):
        raise TypeError(
            f"{owner} expects a ProcessGroup or None as its state, got {type(state).__name__}. "
            f"Register it as ddp_model.register_comm_hook(None, {owner}) or pass a process group; "
            "state objects such as PowerSGDState belong to their own hooks."
        )
    group = comm.resolve_group(state, owner=owner)
    handshake.once(group, owner, policy)
    return group


def gradient_buffer(bucket: GradBucket, owner: str) -> torch.Tensor:
    """The bucket's gradient, checked to be floating point: dense, or the sparse gradient of
    a bucket of its own (``nn.Embedding(..., sparse=True)``), which only hooks that average or
    return it as it is take; the others call :func:`float_buffer`."""
    buffer: torch.Tensor = bucket.buffer()
    if not buffer.is_floating_point():
        raise TypeError(
            f"{owner} received a bucket of dtype {buffer.dtype}; gradient buckets must be "
            "floating point. Keep integer tensors out of the parameters DDP synchronises "
            "(register them as buffers instead)."
        )
    return buffer


def float_buffer(bucket: GradBucket, owner: str) -> torch.Tensor:
    """The bucket's flat gradient; ``TypeError`` where it is not floating point, or sparse
    (naming the hooks that take sparse gradients)."""
    buffer: torch.Tensor = bucket.buffer()
    if buffer.layout == torch.strided and buffer.is_floating_point():  # the usual bucket
        return buffer
    buffer = gradient_buffer(bucket, owner)
    if buffer.layout != torch.strided:
        raise TypeError(
            f"{owner} cannot compress a sparse gradient (bucket {bucket.index()}, "
            f"{buffer.layout}, shape {tuple(buffer.shape)}, from a module such as "
            "nn.Embedding(..., sparse=True)). "
            f"Register {SPARSE_HOOKS} for a model with sparse gradients, or make that module "
            "dense (sparse=False)."
        )
    return buffer
