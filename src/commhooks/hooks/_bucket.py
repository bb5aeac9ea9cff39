"""Argument checks shared by the hooks, run before any collective is issued."""

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from commhooks import comm
from commhooks.state import StatelessState

if TYPE_CHECKING:  # torch.distributed re-exports it without telling type checkers
    from torch._C._distributed_c10d import GradBucket


def group_state(state: Any, owner: str) -> dist.ProcessGroup:
    """Resolve the ``state`` of a stateless hook: a process group, ``None``, or the
    :class:`~commhooks.state.StatelessState` that ``commhooks.register`` gives it.

    Raises:
        TypeError: ``state`` is another hook's state object or anything else that is not a group.
        ValueError: this rank is not in the group.
    """
    if isinstance(state, StatelessState):
        state = state.process_group
    if state is not None and not isinstance(state, (dist.ProcessGroup, int)):
        raise TypeError(
            f"{owner} expects a ProcessGroup or None as its state, got {type(state).__name__}. "
            f"Register it as ddp_model.register_comm_hook(None, {owner}) or pass a process group; "
            "state objects such as PowerSGDState belong to their own hooks."
        )
    return comm.resolve_group(state, owner=owner)


def float_buffer(bucket: "GradBucket", owner: str) -> torch.Tensor:
    """The bucket's flat gradient, checked to be floating point."""
    buffer = bucket.buffer()
    if not buffer.is_floating_point():
        raise TypeError(
            f"{owner} received a bucket of dtype {buffer.dtype}; gradient buckets must be "
            "floating point. Keep integer tensors out of the parameters DDP synchronises "
            "(register them as buffers instead)."
        )
    return buffer
