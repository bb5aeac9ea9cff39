"""Plain averaging, reduced-precision averaging, and wrappers that run any hook in low precision.

Every hook here takes a ``ProcessGroup`` or ``None`` (the default group) as its state.

Note for maintainers: hook modules must not use ``from __future__ import annotations``. DDP
inspects a hook's annotations and rejects them when they are strings.
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from commhooks import comm, handshake, lowrank
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
    ``fp16_compress_hook`` bit for bit wherever PyTorch's stay finite. Where it would not:

    * a rank's value too large for float16 (|x| > 65504) but finite: PyTorch sends ``inf``.
      Here that element is divided by the world size before the cast instead, so an average
      that float16 can hold comes out finite. On CPU, buckets that fit pay only for the check,
      one sum; on an accelerator the masked redo always runs, so the host never waits.
    * the float16 sum itself overflows (the average is beyond float16's range): every rank sees
      the same non-finite sum, so all of them re-send that bucket in its own precision and
      warn once.

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
        reduced,
        lambda result: _cast_back_or_resend(result, buffer, issuer.group, owner),
        *comm.follow_up_options(buffer, bucket.is_last()),
    )


def _cast_down(buffer: torch.Tensor, dtype: torch.dtype, world: int) -> torch.Tensor:
    if dtype != torch.float16:
        return torch.div(buffer, world, out=torch.empty_like(buffer, dtype=dtype))
    # PyTorch's order of operations (cast, then divide), kept for bitwise compatibility with its
    # hook. Summed in float32, the check cannot overflow itself: it is non-finite only when an
    # element of ``low`` is, which is rare, so the common path adds one reduction and no copy.
    low = buffer.to(dtype)
    if low.device.type != "cpu":
        # On an accelerator, reading the check back would make the host wait for the device;
        # a few elementwise passes cost less there than that wait.
        return _divide_overflowed_first(buffer, low, world)
    if bool(torch.isfinite(low.sum(dtype=torch.float32))):
        return low.div_(world)
    return _divide_overflowed_first(buffer, low, world)


def _divide_overflowed_first(buffer: torch.Tensor, low: torch.Tensor, world: int) -> torch.Tensor:
    """Redo, dividing before the cast, only the elements whose cast overflowed.

    Elements that were already ``inf`` or ``NaN`` keep PyTorch's arithmetic, so they reach the
    sum non-finite, as with plain allreduce; every other element keeps its bits.
    """
    # Where ``low`` is infinite, ``buffer`` was either too large for float16 (divided first,
    # it may fit) or infinite itself (divided first, it stays the same infinity).
    early = torch.div(buffer, world, out=torch.empty_like(low))
    return torch.where(torch.isinf(low), early, low.div_(world))


def _cast_back_or_resend(
    result: torch.Tensor, buffer: torch.Tensor, follow_up: dist.ProcessGroup, owner: str
) -> torch.futures.Future[torch.Tensor]:
    # ``result`` is the reduced sum, identical on every rank, so every rank takes the same branch
    # (whether this rank's own input was finite is local, and is only looked at after the
    # re-send, to choose whether to warn).
    if lowrank.is_finite(result):
        return comm.completed(buffer.copy_(result))
    resent = comm.average(buffer, follow_up)
    return resent.then(lambda fut: _warn_if_overflowed(fut.value(), owner, result.dtype))


def _warn_if_overflowed(averaged: torch.Tensor, owner: str, dtype: torch.dtype) -> torch.Tensor:
    # A finite full-precision average means every rank's gradient was finite: the overflow was
    # the reduced precision's. Otherwise the gradient itself was inf/NaN, which is no news here.
    if bool(torch.isfinite(averaged).all()):
        advice = " or use bf16" if dtype == torch.float16 else ""
        warn_once(
            f"{owner}-overflow",
            f"{owner}: a bucket's average, summed in {dtype}, went beyond its range "
            f"(+-{torch.finfo(dtype).max:g}) although every gradient was finite, so that bucket "
            f"was re-sent in {averaged.dtype}. If this repeats, scale the loss down{advice}.",
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
        # One cross-rank check for the wrapper and its hook, at the first call on the group.
        group = comm.resolve_group(getattr(state, "process_group", state), owner=self.owner)
        with handshake.wrapping(self.owner, self.hook, state, group):
            bucket.set_buffer(_saturating_cast(original, self.dtype, self.owner))
            reduced = self.hook(state, bucket)
        return reduced.then(lambda fut: original.copy_(fut.value()))

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
