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

    Not data parallel: the step time with zero communication, the floor every other hook is
    measured against. It checks ``state`` (a process group or ``None``) and the bucket as the
    other stateless hooks do, so a setup wrong for them is reported here too.
    """
    group_state(state, "noop_hook")
    return comm.completed(gradient_buffer(bucket, "noop_hook"))
