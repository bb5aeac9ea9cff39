"""Whether reduced tensors are finite, asked where the reduction is queued and answered later.

A hook that falls back to plain allreduce when some rank's gradient held inf or NaN must read
one number per bucket back to the host. On a CPU that read is free. On a GPU, reading it in the
bucket's follow-up would make each follow-up launch a reduction and wait for it, one bucket
after another once the backward pass is queued: a round trip per bucket with the device idle.
:class:`QueuedFiniteness` instead queues the reduction right behind the collective, with a copy
of its one value into pinned host memory, so that the follow-up (held until the step's last
bucket on a GPU) only waits for that copy: the first bucket's wait finds the device busy, the
others find their totals already on the host.

Nothing here communicates.
"""

import math
import weakref

import torch

from commhooks import _reads

__all__ = ["HeldChecks", "QueuedFiniteness", "finite_each", "held_for", "queues"]

_HALF = (torch.float16, torch.bfloat16)


def queues(tensor: torch.Tensor) -> bool:
    """Whether the finiteness of ``tensor`` is queued when it is reduced, rather than read in
    the follow-up: on a GPU, where a read waits for the device (and on a CPU inside
    :func:`commhooks._reads.as_on_a_gpu`, so that tests run that order)."""
    return not _reads.are_free(tensor)


class QueuedFiniteness:
    """Whether every element of ``tensors`` is finite, their total formed at construction.

    The total is a sum per tensor (half precision summed in float32, where a sum of float16
    values cannot overflow), all added together: one pass with a scalar result. On a CUDA
    device it is copied to pinned host memory without waiting, and an event marks the copy.
    :meth:`all_finite` reads it; only where it is not finite (an inf or NaN, or finite values
    whose sum overflows) are the elements themselves checked, on a device through the same
    pinned copy (a step whose result is not finite falls back to a slower path anyway).
    """

    def __init__(self, *tensors: torch.Tensor) -> None:
        self.tensors = tensors
        sums = [t.sum(dtype=torch.float32) if t.dtype in _HALF else t.sum() for t in tensors]
        self._total = _queued(sum(sums[1:], sums[0])) if sums else None

    def all_finite(self, latest: "QueuedFiniteness | None" = None) -> bool:
        """Whether every element is finite; waits for the queued total, if not there yet.

        Args:
            latest: the check queued last, if known. Where this one's copy is not done yet,
                that one's is waited for first: on one stream it completes after every
                earlier one, so that reading a step's checks one after another waits for the
                device once, not once each.
        """
        if self._total is None:
            return True
        after = latest._total if latest is not None else None
        if math.isfinite(_read(self._total, after)):
            return True
        flags = torch.stack([torch.isfinite(t).all() for t in self.tensors]).all()
        return _read(_queued(flags)) != 0


class HeldChecks:
    """Finiteness checks held until the first one is asked for, then answered all at once.

    On a GPU a hook's decisions wait for the step's last bucket anyway (see
    :func:`commhooks.comm.holds_follow_ups`). Queued one bucket at a time, each check costs
    the host a reduction, a pinned buffer, a copy to the host and an event; held here, the
    step's checks are one batched reduction and one read (:func:`finite_each`), at the first
    decision, and the others find their answers made. Where decisions follow each bucket at
    once (FSDP2's modules), each question settles the checks held so far, its own among them.
    Call from one thread (the hooks' issuer), as its decisions run.
    """

    def __init__(self) -> None:
        self._held: list[tuple[object, tuple[torch.Tensor, ...]]] = []
        self._answers: dict[int, tuple[object, tuple[torch.Tensor, ...], bool]] = {}

    def hold(self, owner: object, *tensors: torch.Tensor) -> None:
        """Hold ``owner``'s check that every element of ``tensors`` is finite."""
        self._held.append((owner, tensors))

    def finite(self, owner: object) -> bool:
        """Whether ``owner``'s tensors are all finite; settles every check held, if its own
        is not answered yet."""
        if id(owner) not in self._answers:
            self._settle()
        answer = self._answers.pop(id(owner), None)
        if answer is None:
            raise RuntimeError("a finiteness check was asked for that was never held")
        return answer[2]

    def _settle(self) -> None:
        held, self._held = self._held, []
        # Answers left from an earlier settling belong to steps abandoned since: dropped.
        self._answers = {}
        each = iter(finite_each([t for _, tensors in held for t in tensors]))
        for owner, tensors in held:
            verdicts = [next(each) for _ in tensors]  # every one taken, in order
            self._answers[id(owner)] = (owner, tensors, all(verdicts))


_held: "weakref.WeakKeyDictionary[object, HeldChecks]" = weakref.WeakKeyDictionary()


def held_for(decider: object) -> HeldChecks:
    """The held checks of the buckets whose decisions ``decider`` runs (a hook's issuer: its
    decisions run on one thread, in order), made at the first call; kept while it lives."""
    held = _held.get(decider)
    if held is None:
        held = _held[decider] = HeldChecks()
    return held


def finite_each(tensors: list[torch.Tensor]) -> list[bool]:
    """Whether each of ``tensors`` is all finite, from one batched pass and one read.

    The common answer, every tensor finite, comes from one flag: PyTorch's unscaling kernel
    (its gradient scaler's) with a scale of one sets it where any element is inf or NaN and
    leaves every value as it was. On a GPU that is one multi-tensor kernel, on a CPU one cheap
    pass a tensor (a sixth of a 2-norm's host time on 96 small tensors). Only where the flag
    is set, or the kernel does not take the tensors (CUDA's has no bfloat16), is each
    tensor's largest magnitude read (its infinity norm, batched): infinite or NaN exactly
    when an element is, whatever the values. On a GPU each read reaches the host through
    pinned memory and an event, which the host waits for.
    """
    if not tensors:
        return []
    if _flag_says_finite(tensors):
        return [True] * len(tensors)
    present = [t for t in tensors if t.numel()]  # an empty tensor has no largest value
    if not present:
        return [True] * len(tensors)
    largest = torch.stack(torch._foreach_norm(present, math.inf, dtype=torch.float32))
    queued = _queued(largest)
    if isinstance(queued, _Queued):
        queued.copied.synchronize()
        largest = queued.host
    each = iter(largest.tolist())
    return [math.isfinite(next(each)) if t.numel() else True for t in tensors]


def _flag_says_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether the unscaling kernel's flag says every element of ``tensors`` is finite;
    ``False`` where it is set, or where the kernel does not take the tensors: CUDA's has no
    bfloat16, and none takes tensors on several devices."""
    first = tensors[0]
    if first.dtype == torch.bfloat16 and first.is_cuda:
        return False
    try:
        flag = _nonfinite_flag(tensors)
    except RuntimeError:  # another device or an unsupported dtype among them (NotImplemented)
        return False
    return _read(_queued(flag)) == 0.0


def _nonfinite_flag(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One float32 element on ``tensors``' device: 1 where any element of them is inf or NaN,
    else 0. The tensors are multiplied by one in place, which changes no bit of a number."""
    device = tensors[0].device
    one = _ONES.get(device)
    if one is None:
        one = _ONES[device] = torch.ones(1, dtype=torch.float32, device=device)
    found = torch.zeros(1, dtype=torch.float32, device=device)
    torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, one)
    return found


# A scale of one per device for the unscaling kernel: made once, only read.
_ONES: dict[torch.device, torch.Tensor] = {}


class _Queued:
    """A small tensor on its way to the host: pinned memory and the event of its copy."""

    def __init__(self, value: torch.Tensor) -> None:
        self.host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
        self.host.copy_(value, non_blocking=True)
        self.copied = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch's own
        self.copied.record()


def _queued(value: torch.Tensor) -> "torch.Tensor | _Queued":
    """``value`` itself on a CPU; on CUDA its copy to the host, queued now."""
    return _Queued(value) if value.is_cuda else value


def _read(value: "torch.Tensor | _Queued", latest: "torch.Tensor | _Queued | None" = None) -> float:
    """The number ``value`` holds; for a queued copy, once the copy is done (asking first, and
    waiting for ``latest``'s copy before its own: see :meth:`QueuedFiniteness.all_finite`)."""
    if not isinstance(value, _Queued):
        return float(value)
    if not _reached(value.copied):
        if isinstance(latest, _Queued):
            latest.copied.synchronize()
        if not _reached(value.copied):  # queued on another stream than ``latest``
            value.copied.synchronize()
    return float(value.host)


def _reached(event: torch.cuda.Event) -> bool:
    """Whether the device has passed ``event`` (asking waits for nothing)."""
    return bool(event.query())  # type: ignore[no-untyped-call]  # torch's own
