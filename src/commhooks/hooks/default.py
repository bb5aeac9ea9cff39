"""Plain averaging, reduced-precision averaging, and wrappers that run any hook in low precision.

Every hook here takes a ``ProcessGroup`` or ``None`` (the default group) as its state.

Note for maintainers: hook modules must not use ``from __future__ import annotations``. DDP
inspects a hook's annotations and rejects them when they are strings.
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from commhooks import _reads, comm, handshake
from commhooks.hooks._bucket import (
    GradBucket,
    finished_by_polling,
    float_buffer,
    gradient_buffer,
    group_state,
)
from commhooks.hooks._half import average_held, average_in, saturating_cast

__all__ = [
    "allreduce_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
]

Hook = Callable[[Any, GradBucket], "torch.futures.Future[torch.Tensor]"]


def allreduce_hook(
    process_group: dist.ProcessGroup | None, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket across the group: the same result, bit for bit, as DDP without a hook.

    Sparse gradients (``nn.Embedding(..., sparse=True)``, in buckets of their own) included.

    Args:
        process_group: group to average over; ``None`` for the default group.
        bucket: the gradient bucket DDP hands to the hook.
    """
    group = group_state(process_group, "allreduce_hook")
    buffer = gradient_buffer(bucket, "allreduce_hook")
    if not finished_by_polling(bucket, buffer):
        return comm.average(buffer, group)
    averaged = comm.average_polled(buffer, group)
    comm.poll(bucket.is_last())
    return averaged


def fp16_compress_hook(
    process_group: dist.ProcessGroup | None, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in float16, halving the bytes on the wire.

    The arithmetic is PyTorch's (cast, then divide by the world size), so results match its
    ``fp16_compress_hook`` bit for bit wherever PyTorch's stay finite, at the same cost plus one
    pass that reads the sum's minimum and maximum. Where PyTorch's would not stay finite:

    * a rank's value too large for float16 (|x| > 65504) but finite: PyTorch sends ``inf``.
      Here the elements whose sum is not finite are sent again, divided by the world size
      before the cast where the cast overflowed, so an average that float16 can hold comes out
      finite.
    * the average itself is beyond float16's range: every rank sees the same non-finite sum, so
      all of them re-send that bucket in its own precision and warn once.

    Gradients that were already non-finite come out non-finite, exactly as with plain
    allreduce. On an accelerator the host waits for the device once a step, at the last
    bucket, never once a bucket. Sparse gradients are refused (use ``allreduce_hook``).
    """
    return _cast_average(process_group, bucket, torch.float16, "fp16_compress_hook")


def bfloat16_compress_hook(
    process_group: dist.ProcessGroup | None, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in bfloat16: half the bytes, float32's range, fewer mantissa bits.

    Works on gloo/CPU as well as NCCL. The arithmetic is PyTorch's ``bf16_compress_hook``'s
    (cast, then divide); a sum beyond bfloat16's range is handled as in ``fp16_compress_hook``.
    """
    return _cast_average(process_group, bucket, torch.bfloat16, "bf16_compress_hook")


# DDP refuses any callable *named* ``bf16_compress_hook`` on machines without CUDA and NCCL,
# whatever it does. The function keeps another ``__name__`` so it is accepted on CPU too.
bf16_compress_hook = bfloat16_compress_hook


def _cast_average(
    state: Any, bucket: GradBucket, dtype: torch.dtype, owner: str
) -> torch.futures.Future[torch.Tensor]:
    group = group_state(state, owner)
    buffer = float_buffer(bucket, owner)
    if not _reads.are_free(buffer):  # a GPU's: the sum held with the step's others
        return average_held(dtype, buffer, group, bucket.is_last(), owner)
    polled = finished_by_polling(bucket, buffer)
    issuer = comm.issuer_for(group)
    return average_in(dtype, buffer, group, issuer, bucket.is_last(), owner, polled)


def fp16_compress_wrapper(hook: Hook) -> Hook:
    """Run ``hook`` on a float16 copy of the bucket; DDP casts its result back.

    Composes with any hook of this package, stateful ones included:
    ``fp16_compress_wrapper(powerSGD_hook)`` compresses the low-rank factors' traffic too.
    Values beyond float16's range (|x| > 65504) are clipped to it before the hook runs, with a
    warning on CPU, rather than turned into ``inf``. As with PyTorch's wrapper, the future holds
    the float16 copy with the hook's result in it: DDP casts that back as it copies it into the
    gradients, one pass fewer than casting it into the bucket first.
    """
    return _cast_wrapper(hook, torch.float16, "fp16")


def bf16_compress_wrapper(hook: Hook) -> Hook:
    """Run ``hook`` on a bfloat16 copy of the bucket, as ``fp16_compress_wrapper``. Works on CPU."""
    return _cast_wrapper(hook, torch.bfloat16, "bf16")


def _cast_wrapper(hook: Hook, dtype: torch.dtype, short: str) -> Hook:
    if not callable(hook):
        raise TypeError(
            f"{short}_compress_wrapper wraps a hook function; got {type(hook).__name__}."
        )
    return CastWrapper(hook, dtype, short)


class CastWrapper:
    """A hook that runs ``hook`` on a down-cast copy of the bucket.

    A class rather than a closure so that wrapped hooks pickle (launchers copy them to workers).
    """

    def __init__(self, hook: Hook, dtype: torch.dtype, short: str) -> None:
        self.hook, self.dtype = hook, dtype
        self.owner = f"{short}_compress_wrapper"
        # Not ``bf16_compress_wrapper_hook``: DDP refuses that name without CUDA (see above).
        self.__name__ = f"{short}_cast_{getattr(hook, '__name__', 'hook')}"
        self.__qualname__ = self.__name__
        self.__wrapped__ = hook

    def __call__(self, state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        low = saturating_cast(float_buffer(bucket, self.owner), self.dtype, self.owner)
        # One cross-rank check for the wrapper and its hook, at the first call on the group.
        group = comm.resolve_group(getattr(state, "process_group", state), owner=self.owner)
        with handshake.wrapping(self.owner, self.hook, state, group):
            bucket.set_buffer(low)
            reduced = self.hook(state, bucket)
        # Nothing to copy when the hook's result is ``low`` itself, as with allreduce_hook.
        return comm.then(reduced, lambda fut: low.copy_(fut.value()))

    def __repr__(self) -> str:
        return f"{self.owner}({getattr(self.hook, '__name__', self.hook)!r})"
