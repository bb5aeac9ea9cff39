"""The buckets a hook's state last averaged, so that the steps after a restart are cut the same
way; and :class:`FlatBucket`, a flat tensor with a bucket's methods.

What a compressing hook sends, and the state it keeps, can depend on which parameters share a
bucket: the quantized average's blocks and which rank owns which elements, the batched PowerSGD
hook's matrix, even the order a ring sums an element in. A fresh DDP model hands its hook the
first step (two with ``static_graph=True``) in one bucket of every parameter, and rebuilds its
buckets after that: a resumed run would average those steps otherwise than the uninterrupted
run did. :class:`SavedBuckets` remembers the buckets of the last step; saved with the state,
they cut DDP's buckets after a load into the saved run's, until DDP hands those over itself.

Hook modules must not use ``from __future__ import annotations``: DDP rejects string annotations.
"""

from collections.abc import Callable, Sequence
from typing import Any

import torch

from commhooks import comm
from commhooks.hooks._bucket import GradBucket
from commhooks.state import StateDictError, check_count

__all__ = ["FlatBucket", "SavedBuckets", "parse_buckets", "split"]

Numbers = tuple[int, ...]
"""The parameters of a bucket, by the state's stable numbers, in the bucket's order."""
Future = torch.futures.Future[torch.Tensor]
Run = Callable[[Any], Future]
"""The average of one bucket (DDP's, or a :class:`FlatBucket` cut from it)."""
Number = Callable[[list[torch.Tensor]], Numbers]
"""The state's stable numbers of a bucket's parameters (:mod:`commhooks.numbering`)."""


class FlatBucket:
    """A flat tensor with a gradient bucket's methods, for a hook that keys its state by the
    parameters it is handed: a saved bucket cut from DDP's, or DiLoCo's fragment, which keeps
    its memories from sync to sync.

    ``parts``: the gradients, where they are not ``flat`` cut by ``params`` (a worker's share);
    ``last``: whether it ends its step (the hook counts steps on the last bucket).
    """

    def __init__(
        self,
        index: int,
        flat: torch.Tensor,
        params: Sequence[torch.Tensor],
        parts: list[torch.Tensor] | None = None,
        last: bool = True,
    ) -> None:
        self._index, self._buffer, self._params = index, flat, list(params)
        self._parts, self._last = parts, last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return split(self._buffer, self._params) if self._parts is None else self._parts

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def is_last(self) -> bool:
        return self._last

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer


class SavedBuckets:
    """The buckets of a hook's last step, and ``saved`` (a saved run's,
    :meth:`saved`'s output) that DDP's buckets are cut into until it hands them over itself.

    Only buckets DDP settled on are worth saving (:attr:`settled`): DDP hands a fresh model's
    first step (two with ``static_graph=True``) over in buckets of its own, then rebuilds them.
    Pickled as its saved form, as a loaded one cuts the next steps.
    """

    def __init__(self, saved: Sequence[Numbers] = ()) -> None:
        self._start(saved)

    def _start(self, saved: Sequence[Numbers]) -> None:
        self.last: list[Numbers] = list(saved)  # the last step's buckets, by index
        self.settled = bool(saved)
        self._replay: list[Numbers] | None = list(saved) or None
        self._first: list[Numbers] | None = None  # the first step's, since made or loaded
        self._step: dict[int, Numbers] = {}  # this step's buckets so far
        self._cutting = False  # whether this step cut a bucket into saved ones
        self._steps = 0  # steps seen since made or loaded
        self._frozen = False  # DDP's buckets settled, and the same two steps running

    def __getstate__(self) -> dict[str, Any]:
        return {"saved": self.saved()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._start(state["saved"])

    def saved(self) -> list[Numbers]:
        """The buckets to save: the last step's where DDP had settled on them, else none."""
        return list(self.last) if self.settled else []

    def average(self, bucket: GradBucket, number: Number, run: Run) -> Future:
        """``run(bucket)``, or, after a load until DDP hands over the saved buckets, ``run`` on
        each of the saved buckets ``bucket`` holds. Remembers which parameters (``number``
        gives their numbers) each of DDP's buckets held, until they stop changing (a
        fragment's or an FSDP2 shard's bucket holds the same at every step)."""
        if self._frozen or not isinstance(bucket, GradBucket):
            return run(bucket)
        numbers = number(bucket.parameters())
        parts = None if self._replay is None else self._cut(numbers)
        if parts is None or parts == [(bucket.index(), numbers)]:  # as it is, or as saved
            self._note(bucket.index(), numbers, bucket.is_last(), as_saved=parts is not None)
            return run(bucket)
        return self._average_parts(bucket, numbers, parts, run)

    def _cut(self, numbers: Numbers) -> list[tuple[int, Numbers]] | None:
        """The saved buckets (with their indices) that ``numbers`` is made of, or ``None``
        where it holds parts of them (resumed with another ``bucket_cap_mb``: DDP's buckets
        are then taken as they are, as they will be after its rebuild)."""
        assert self._replay is not None
        held = set(numbers)
        parts = [(i, saved) for i, saved in enumerate(self._replay) if set(saved) <= held]
        if sorted(n for _, saved in parts for n in saved) == sorted(numbers):
            return parts
        return None

    def _average_parts(
        self, bucket: GradBucket, numbers: Numbers, parts: list[tuple[int, Numbers]], run: Run
    ) -> Future:
        """Average each saved bucket of ``bucket`` as a bucket of its own (a copy of its
        gradients, in the saved order), then put the averages back in ``bucket``'s buffer."""
        grads = dict(zip(numbers, bucket.gradients()))
        params = dict(zip(numbers, bucket.parameters()))
        last, self._cutting = bucket.is_last(), True
        futures: list[Future] = []
        for k, (index, saved) in enumerate(parts):
            flat = torch.cat([grads[n].reshape(-1) for n in saved])
            ends = last and k == len(parts) - 1
            futures.append(run(FlatBucket(index, flat, [params[n] for n in saved], last=ends)))
            self._note(index, saved, ends, as_saved=True)
        targets = [[grads[n] for n in saved] for _, saved in parts]
        buffer = bucket.buffer()
        return comm.then(
            torch.futures.collect_all(futures), lambda done: _put_back(done, targets, buffer)
        )

    def _note(self, index: int, numbers: Numbers, last: bool, as_saved: bool) -> None:
        """Remember a bucket of this step; at its last bucket, the step's buckets: settled
        where cut as saved, other than the first step's (DDP rebuilt them), or after DDP's
        first two steps; and cut no more once a step needed no cut, or after two steps (DDP
        then hands over the buckets of the bucket_cap_mb it was given, maybe another)."""
        self._step[index] = numbers
        if not last:
            return
        previous, self.last = self.last, [self._step[i] for i in sorted(self._step)]
        self._first = self._first or self.last
        self._steps += 1
        self.settled = as_saved or self.last != self._first or self._steps > 2
        if not self._cutting or self._steps >= 2:
            self._replay = None
        # DDP rebuilds its buckets once: settled and unchanged, they are not noted again.
        self._frozen = self._replay is None and self.settled and self.last == previous
        self._step, self._cutting = {}, False


def _put_back(
    done: torch.futures.Future[list[torch.futures.Future[torch.Tensor]]],
    targets: list[list[torch.Tensor]],
    buffer: torch.Tensor,
) -> torch.Tensor:
    """Each part's average into its gradients' places in ``buffer``."""
    for future, grads in zip(done.value(), targets):
        averaged = future.wait()  # raises if it failed; on a GPU, orders the streams
        for grad, average in zip(grads, split(averaged, grads)):
            grad.copy_(average)
    return buffer


def split(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat``, one shaped as each of ``like``, in order."""
    out, offset = [], 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


def parse_buckets(where: str, raw: Any, name: str = "buckets") -> list[Numbers]:
    """Saved buckets (entry ``name``): lists of parameter numbers, no number in two (else
    ``StateDictError``, naming the entry and what it must be)."""
    entry = f"{where} {name!r}"
    if not isinstance(raw, list) or not all(isinstance(b, (list, tuple)) and b for b in raw):
        raise StateDictError(
            f"{entry} must be a list of buckets, each a non-empty list of parameter numbers; "
            f"got {raw!r:.80}. Pass the unchanged output of state_dict()."
        )
    out = [tuple(check_count(f"{entry}[{i}]", n) for n in b) for i, b in enumerate(raw)]
    every = [n for b in out for n in b]
    if len(every) != len(set(every)):
        raise StateDictError(f"{entry} names a parameter in two buckets: {raw!r:.80}.")
    return out
