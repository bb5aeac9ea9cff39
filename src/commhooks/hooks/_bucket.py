"""Argument checks shared by the hooks, run before any collective is issued."""

from typing import Any

import torch
import torch.distributed as dist

from commhooks import comm, handshake


def group_state(state: Any, owner: str) -> dist.ProcessGroup:
    """Resolve the ``state`` of a stateless hook: a process group or ``None``.

    Raises:
        TypeError: ``state`` is a hook state object or anything else that is not a group.
        ValueError: this rank is not in the group.
    """
    if state is not None and not isinstance(state, (dist.ProcessGroup, int)):
        raise TypeError(
            f"{owner} expects a ProcessGroup or None as its state, got {type(state).__name__}. "
            f"Register it as ddp_model.register_comm_hook(None, {owner}) or pass a process group; "
            "state objects such as PowerSGDState belong to their own hooks."
        )
    group = comm.resolve_group(state, owner=owner)
    handshake.once(group, owner)
    return group


def float_buffer(bucket: dist.GradBucket, owner: str) -> torch.Tensor:
    """The bucket's flat gradient, checked to be floating point."""
    buffer = bucket.buffer()
    if not buffer.is_floating_point():
        raise TypeError(
            f"{owner} received a bucket of dtype {buffer.dtype}; gradient buckets must be "
            "floating point. Keep integer tensors out of the parameters DDP synchronises "
            "(register them as buffers instead)."
        )
    return buffer
