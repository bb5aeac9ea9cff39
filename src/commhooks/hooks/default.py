"""Plain averaging, reduced-precision averaging, and wrappers that run any hook in low precision.

Every hook here takes a ``ProcessGroup`` or ``None`` (the default group) as its state.

Note for maintainers: hook modules must not use ``from __future__ import annotations``. DDP
inspects a hook's annotations and rejects them when they are strings.
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from commhooks import comm
from commhooks._warnings import warn_once
from commhooks.hooks._bucket import float_buffer, group_state

__all__ = [
    "allreduce_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
]

Hook = Callable[[Any, dist.GradBucket], "torch.futures.Future[torch.Tensor]"]


def allreduce_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket across the group: the same result, bit for bit, as DDP without a hook.

    Args:
        process_group: group to average over; ``None`` for the default group.
        bucket: the gradient bucket DDP hands to the hook.
    """
    group = group_state(process_group, "allreduce_hook")
    return comm.average(float_buffer(bucket, "allreduce_hook"), group)


def fp16_compress_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in float16, halving the bytes on the wire.

    The arithmetic is PyTorch's (cast, then divide by the world size), so results match its
    ``fp16_compress_hook`` bit for bit. Where float16 cannot hold the result (a value above
    65504 in a rank's gradient or in the average), PyTorch returns ``inf``; here every rank sees
    the non-finite sum, so all of them re-send that bucket in its own precision and warn once.
    Gradients that were already non-finite come out non-finite, exactly as with plain allreduce.
    """
    return _cast_average(process_group, bucket, torch.float16, "fp16_compress_hook")


def bfloat16_compress_hook(
    process_group: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in bfloat16: half the bytes, float32's range, fewer mantissa bits.

    Works on gloo/CPU as well as NCCL. Divides before the cast, then sums in bfloat16.
    """
    return _cast_average(process_group, bucket, torch.bfloat16, "bf16_compress_hook")


# DDP refuses any callable *named* ``bf16_compress_hook`` on machines without CUDA and NCCL,
# whatever it does. The function keeps another ``__name__`` so it is accepted on CPU too.
bf16_compress_hook = bfloat16_compress_hook


def _cast_average(
    state: Any, bucket: dist.GradBucket, dtype: torch.dtype, owner: str
) -> torch.futures.Future[torch.Tensor]:
    group = group_state(state, owner)
    buffer = float_buffer(bucket, owner)
    issuer = comm.issuer_for(group)
    low = _cast_down(buffer, dtype, group.size())
    reduced = comm.allreduce(low, group)
    # The possible re-send is a follow-up collective: its slot is reserved now, on DDP's thread.
    return issuer.then(
        reduced, lambda result: _cast_back_or_resend(result, buffer, issuer.group, owner)
    )


def _cast_down(buffer: torch.Tensor, dtype: torch.dtype, world: int) -> torch.Tensor:
    if dtype == torch.float16:
        # PyTorch's order of operations, kept for bitwise compatibility with its hook.
        return buffer.to(dtype).div_(world)
    return torch.div(buffer, world, out=torch.empty_like(buffer, dtype=dtype))


def _cast_back_or_resend(
    result: torch.Tensor, buffer: torch.Tensor, follow_up: dist.ProcessGroup, owner: str
) -> torch.futures.Future[torch.Tensor]:
    # ``result`` is identical on every rank, so every rank takes the same branch.
    if bool(torch.isfinite(result).all()):
        return comm.completed(buffer.copy_(result))
    resent = comm.average(buffer, follow_up)
    return resent.then(lambda fut: _warn_if_overflowed(fut.value(), owner, result.dtype))


def _warn_if_overflowed(averaged: torch.Tensor, owner: str, dtype: torch.dtype) -> torch.Tensor:
    if bool(torch.isfinite(averaged).all()):
        warn_once(
            f"{owner}-overflow",
            f"{owner}: a bucket's average did not fit in {dtype}, so that bucket was re-sent in "
            f"{averaged.dtype}. If this repeats, scale the loss down or use bf16.",
        )
    return averaged


def fp16_compress_wrapper(hook: Hook) -> Hook:
    """Run ``hook`` on a float16 copy of the bucket and cast its result back.

    Composes with any hook of this package, stateful ones included:
    ``fp16_compress_wrapper(powerSGD_hook)`` compresses the low-rank factors' traffic too.
    Values beyond float16's range (|x| > 65504) are clipped to it before the hook runs, with a
    warning, rather than turned into ``inf``.
    """
    return _cast_wrapper(hook, torch.float16, "fp16")


def bf16_compress_wrapper(hook: Hook) -> Hook:
    """Run ``hook`` on a bfloat16 copy of the bucket and cast its result back. Works on CPU."""
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

    def __call__(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        original = float_buffer(bucket, self.owner)
        bucket.set_buffer(_saturating_cast(original, self.dtype, self.owner))
        return self.hook(state, bucket).then(lambda fut: original.copy_(fut.value()))

    def __repr__(self) -> str:
        return f"{self.owner}({getattr(self.hook, '__name__', self.hook)!r})"


def _saturating_cast(buffer: torch.Tensor, dtype: torch.dtype, owner: str) -> torch.Tensor:
    low = buffer.to(dtype)
    if dtype != torch.float16 or not bool(torch.isinf(low).any()):
        return low
    limit = torch.finfo(dtype).max
    overflowed = torch.isinf(low) & torch.isfinite(buffer)
    warn_once(
        f"{owner}-clip",
        f"{owner}: {int(overflowed.sum())} gradient values exceed the float16 range and were "
        f"clipped to +-{limit:g}. Scale the loss down or use bf16_compress_wrapper.",
    )
    return torch.where(overflowed, buffer.clamp(-limit, limit).to(dtype), low)
