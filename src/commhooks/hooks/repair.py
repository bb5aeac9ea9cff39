"""``on_nonfinite="repair"``: a bucket whose compressed average is not finite is averaged again.

By default every hook returns what its collectives give, as PyTorch's hooks do: a gradient that
holds inf or NaN, or an fp16 sum beyond float16's range, comes back non-finite, a loss scaler
(``torch.amp.GradScaler``) skips the step and lowers its scale, and no hook reads anything back
from the device to decide anything. The hooks' own memories (error feedback, PowerSGD's
factors) are protected on the device either way: a step whose sum is not finite leaves them as
they were.

A user who would rather have the finite average where one exists (a rank's value too large for
float16 whose average fits, a quantized sum that overflowed) turns the repair on. Then the hook
keeps a copy of each bucket's gradient, and at the step's last bucket one batched check of
every bucket's result is read back (one wait for the device a step); each bucket whose result
is not finite is averaged again in its own precision, plain allreduce's result, with a warning
naming it. A caller that waits for each bucket before handing over the next (FSDP2's shards)
decides each bucket at once, inside :func:`deciding_each_bucket`.

Every rank holds the same results (they are reduced), so every rank re-sends the same buckets,
in bucket order, on DDP's thread: the same collectives in the same order everywhere.
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

__all__ = ["POLICIES", "PROPAGATE", "REPAIR", "deciding_each_bucket", "policy_of", "repaired"]

PROPAGATE, REPAIR = "propagate", "repair"
POLICIES = (PROPAGATE, REPAIR)

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
    """Within this block a repaired bucket is decided at once, not at the step's last bucket:
    for callers that wait for each bucket's result before they hand over the next."""
    before, _now.each = _now.each, True
    try:
        yield
    finally:
        _now.each = before


def policy_of(state: Any) -> str:
    """The ``on_nonfinite`` policy of a hook's state: its own where it has one (a
    :class:`~commhooks.state.HookState`), :data:`PROPAGATE` for a process group or ``None``."""
    return state.on_nonfinite if isinstance(state, HookState) else PROPAGATE


def repaired(
    policy: str,
    bucket: Any,
    group: dist.ProcessGroup,
    owner: str,
    run: Callable[[], "Future[torch.Tensor]"],
) -> "Future[torch.Tensor]":
    """``run()``, the hook's work on ``bucket``, under ``policy``.

    With :data:`PROPAGATE` (or inside another repair: a wrapper's inner hook) that is all.
    With :data:`REPAIR` the bucket's gradient is copied first, and the future returned
    completes once the step's results are checked (see the module's note).
    """
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
    """The values of boolean tensors on the device, read back to the host at once: packed as
    bits into 64-bit words, one ``item()`` where the step has at most 62 buckets."""
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
