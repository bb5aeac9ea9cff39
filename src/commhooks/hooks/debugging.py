"""Hooks for measuring, not for training."""

import torch
import torch.distributed as dist

from commhooks import comm
from commhooks.hooks._bucket import GradBucket, gradient_buffer, group_state

__all__ = ["noop_hook"]


def noop_hook(
    state: dist.ProcessGroup | None, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Return each rank's local gradient untouched, communicating nothing.

    Training with it is no longer data parallel; its purpose is the step time with zero
    communication, the floor that every other hook is measured against. It checks its
    arguments as the other stateless hooks do, so that a setup that is wrong for them is
    reported here too rather than only once a real hook is swapped in. Sparse gradients are
    returned untouched too.

    Args:
        state: a process group or ``None`` (the default group); only validated.
        bucket: the gradient bucket DDP hands to the hook.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        TypeError: ``state`` is not a group, or the bucket is not floating point.
        ValueError: this rank is not in the group ``state``.
    """
    group_state(state, "noop_hook")
    return comm.completed(gradient_buffer(bucket, "noop_hook"))
