"""Plain averaging, reduced-precision averaging, and wrappers that run any hook in low precision.

The hooks take a ``ProcessGroup``, ``None`` (the default group) or the ``StatelessState``
``commhooks.register`` makes as their state; a wrapper takes whatever its hook takes.
Hook modules must not use ``from __future__ import annotations``: DDP rejects string annotations.
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from commhooks import comm, handshake
from commhooks.compress import cpu_kernels
from commhooks.hooks._bucket import GradBucket, float_buffer, gradient_buffer, group_state
from commhooks.hooks.repair import policy_of, repaired

__all__ = [
    "allreduce_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
]

Hook = Callable[[Any, GradBucket], "torch.futures.Future[torch.Tensor]"]


def allreduce_hook(process_group: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket across ``process_group`` (``None``: the default group; or the
    ``StatelessState`` ``commhooks.register`` makes): bit for bit DDP's result without a hook,
    sparse gradients included."""
    group = group_state(process_group, "allreduce_hook")
    buffer = gradient_buffer(bucket, "allreduce_hook")
    policy = policy_of(process_group)
    return repaired(policy, bucket, group, "allreduce_hook", lambda: comm.average(buffer, group))


def fp16_compress_hook(
    process_group: Any, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in float16, halving the bytes on the wire.

    PyTorch's arithmetic, pass for pass, so bitwise PyTorch's ``fp16_compress_hook``: a value
    beyond float16's range (|x| > 65504) is sent as ``inf``, and a loss scaler skips the step.
    With ``on_nonfinite="repair"`` (``register(ddp, "fp16", on_nonfinite="repair")``) a bucket
    whose float16 sum is not finite is averaged again in its own precision. Sparse gradients
    are refused (use ``allreduce_hook``).
    """
    return _cast_average(process_group, bucket, torch.float16, "fp16_compress_hook")


def bfloat16_compress_hook(
    process_group: Any, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in bfloat16: half the bytes, float32's range, fewer mantissa bits.

    Works on gloo/CPU as well as NCCL, with PyTorch's ``bf16_compress_hook``'s arithmetic (on
    CPU the cast and the division are one pass with its bits). ``on_nonfinite`` as in
    ``fp16_compress_hook``.
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
    return repaired(
        policy_of(state), bucket, group, owner, lambda: average_in(buffer, dtype, group)
    )


def average_in(
    buffer: torch.Tensor, dtype: torch.dtype, group: dist.ProcessGroup
) -> torch.futures.Future[torch.Tensor]:
    """Average ``buffer`` across ``group`` in ``dtype``: cast, divide, sum, cast back into
    ``buffer`` in the one callback."""
    world = comm.size(group)
    if dtype == torch.bfloat16 and buffer.is_cpu:  # one fused pass, PyTorch's bits
        low = torch.empty_like(buffer, dtype=dtype)
        if not cpu_kernels.bfloat16_scaled(buffer, low, world):
            low.copy_(buffer).div_(world)
    else:
        low = buffer.to(dtype).div_(world)
    return comm.allreduce_then(low, group, buffer.copy_)


def fp16_compress_wrapper(hook: Hook) -> Hook:
    """Run ``hook`` on a float16 copy of the bucket; DDP casts its result back.

    Composes with any hook of this package: ``fp16_compress_wrapper(powerSGD_hook)`` sends the
    factors in float16. Values beyond float16's range become ``inf``, as in PyTorch's wrapper
    (with the state's ``on_nonfinite="repair"``, such a bucket is averaged again in its own
    precision). The future holds the float16 copy, which DDP casts as it copies it into the
    gradients: one pass fewer than casting it into the bucket first.
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
    """A hook that runs ``hook`` on a down-cast copy of the bucket (a class, not a closure,
    so that wrapped hooks pickle: launchers copy them to workers)."""

    def __init__(self, hook: Hook, dtype: torch.dtype, short: str) -> None:
        self.hook, self.dtype = hook, dtype
        self.owner = f"{short}_compress_wrapper"
        # Not ``bf16_compress_wrapper_hook``: DDP refuses that name without CUDA (see above).
        self.__name__ = f"{short}_cast_{getattr(hook, '__name__', 'hook')}"
        self.__qualname__ = self.__name__
        self.__wrapped__ = hook

    def __call__(self, state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        # One cross-rank check for the wrapper and its hook, at the first call on the group.
        group = comm.resolve_group(getattr(state, "process_group", state), owner=self.owner)
        with handshake.wrapping(self.owner, self.hook, state, group):
            return repaired(
                policy_of(state), bucket, group, self.owner, lambda: self._run(state, bucket)
            )

    def _run(self, state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        low = float_buffer(bucket, self.owner).to(self.dtype)
        bucket.set_buffer(low)
        reduced = self.hook(state, bucket)
        # Nothing to copy when the hook's result is ``low`` itself, as with allreduce_hook.
        return comm.then(reduced, lambda fut: _into(low, fut.value()))

    def __repr__(self) -> str:
        return f"{self.owner}({getattr(self.hook, '__name__', self.hook)!r})"


def _into(low: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    return low if result is low else low.copy_(result)
