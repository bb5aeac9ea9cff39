"""``on_nonfinite="repair"``: a bucket whose compressed average is not finite is averaged again.

By default a hook returns what its collectives give, as PyTorch's do: a non-finite sum comes
back non-finite, a loss scaler skips the step, and nothing is read back from the device (the
hooks' memories are kept on the device either way).

With the repair the hook keeps a copy of each bucket's gradient; at the step's last bucket one
batched check of every result is read back (one wait a step), and each bucket whose result is
not finite is averaged again in its own precision, with a warning naming it. The results are
reduced, so every rank re-sends the same buckets, in order, on DDP's thread. A caller that
waits for each bucket (FSDP2) decides each at once, inside :func:`deciding_each_bucket`.
"""

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from commhooks import comm
from commhooks._warnings import warn_once
from commhooks.state import HookState

__all__ = ["PROPAGATE", "REPAIR", "deciding_each_bucket", "policy_of", "repaired"]

PROPAGATE, REPAIR = "propagate", "repair"

Future = torch.futures.Future


@dataclass
class _Held:
    """One bucket of the step, waiting for the decision."""

    index: int
    original: torch.Tensor  # the gradient as the hook received it
    result: "Future[torch.Tensor]"  # the hook's own future
    out: "Future[torch.Tensor]"  # what DDP waits on
    owner: str


class _Step:
    """The buckets of one group's current step, held until its last bucket."""

    def __init__(self) -> None:
        self.held: list[_Held] = []

    def file(self, bucket: _Held, decide: bool, group: dist.ProcessGroup) -> None:
        if any(h.index == bucket.index for h in self.held):
            self.abandon()  # the same bucket again: the last step never reached its last bucket
        self.held.append(bucket)
        if decide:
            held, self.held = self.held, []
            _decide(held, group)

    def abandon(self) -> None:
        for h in self.held:
            comm.fail(h.out, RuntimeError("the step this bucket belonged to was abandoned"))
        self.held = []


_steps: "weakref.WeakKeyDictionary[dist.ProcessGroup, _Step]" = weakref.WeakKeyDictionary()


class _Deciding:
    each = False  # inside deciding_each_bucket
    inside = False  # a repair is running its hook: an inner hook does not repair again


_now = _Deciding()


@contextlib.contextmanager
def deciding_each_bucket() -> Iterator[None]:
    """Within this block a repaired bucket is decided at once, not at the step's last bucket."""
    before, _now.each = _now.each, True
    try:
        yield
    finally:
        _now.each = before


def policy_of(state: Any) -> str:
    """The ``on_nonfinite`` of a hook's state; :data:`PROPAGATE` for a process group."""
    return state.on_nonfinite if isinstance(state, HookState) else PROPAGATE


def repaired(
    policy: str,
    bucket: Any,
    group: dist.ProcessGroup,
    owner: str,
    run: Callable[[], "Future[torch.Tensor]"],
) -> "Future[torch.Tensor]":
    """``run()``, the hook's work on ``bucket``, under ``policy``: with :data:`REPAIR` (outside
    another repair) the gradient is copied first, and the future completes once checked."""
    if policy != REPAIR or _now.inside:
        return run()
    original = bucket.buffer().clone()
    _now.inside = True
    try:
        result = run()
    finally:
        _now.inside = False
    out: Future[torch.Tensor] = comm.new_future(comm.future_devices(original))
    held = _Held(bucket.index(), original, result, out, owner)
    step = _steps.get(group)
    if step is None:
        step = _steps[group] = _Step()
    step.file(held, bucket.is_last() or _now.each, group)
    return held.out


def _decide(held: list[_Held], group: dist.ProcessGroup) -> None:
    """Check every held result with one read; send the non-finite buckets again."""
    values: list[torch.Tensor | None] = []
    for h in held:
        try:
            values.append(h.result.wait())
        except BaseException as exc:  # a failed collective: that bucket fails with it
            comm.fail(h.out, exc)
            values.append(None)
    finite = iter(_read_flags([_all_finite(v) for v in values if v is not None]))
    for h, value in zip(held, values):
        if value is None:
            continue
        if next(finite):
            h.out.set_result(value)
            continue
        warn_once(
            f"repair-{h.owner}-{h.index}",
            f"{h.owner}: bucket {h.index}'s average was not finite, so it was averaged again in "
            f"{h.original.dtype} (on_nonfinite='repair'). If its gradients are finite, that "
            "average is; otherwise it stays non-finite, as plain allreduce's would.",
        )
        comm.chain(comm.average(h.original, group), h.out)


_WORD = 62  # flags a 64-bit integer carries, read back as one


def _read_flags(flags: list[torch.Tensor]) -> list[bool]:
    """Boolean tensors on the device read back at once, as bits of 64-bit words: one
    ``item()`` for up to 62 buckets."""
    if not flags:
        return []
    bits = torch.stack(flags).to(torch.int64)
    padded = torch.nn.functional.pad(bits, (0, -len(flags) % _WORD)).view(-1, _WORD)
    shifts = torch.arange(_WORD, device=bits.device)
    words = (padded << shifts).sum(dim=1)
    read = [int(words.item())] if words.numel() == 1 else words.tolist()
    return [bool(read[i // _WORD] >> (i % _WORD) & 1) for i in range(len(flags))]


def _all_finite(value: torch.Tensor) -> torch.Tensor:
    """Whether every element of ``value`` is finite, as a tensor on its device (no read)."""
    if value.layout != torch.strided:
        value = value.coalesce().values()
    return torch.isfinite(value).all()
