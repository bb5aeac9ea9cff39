"""Stable numbers for the parameters DDP hands to a hook, whatever its bucket layout.

State kept per bucket index is applied to the wrong tensors once DDP rebuilds its buckets after
the first step, and again after a restart (a fresh DDP starts with its initial layout). State
kept per parameter is not, provided each parameter gets the same number in every run:
:class:`ParameterNumbering` gives it one from the order in which DDP presents the parameters.
"""

import weakref
from collections.abc import Sequence

import torch

__all__ = ["ParameterNumbering"]


class ParameterNumbering:
    """Numbers parameters from the end of DDP's list, the same for any bucket size.

    DDP's first step hands the hooks one bucket of all its parameters, or (with
    ``find_unused_parameters=True``) buckets of consecutive runs, the last run first. Numbering
    each bucket's new parameters from its end gives the last parameter 0, the one before it 1,
    and so on either way (not where several dtypes are bucketed apart). Parameters are held
    weakly; the numbering is not saved but found again at the first step.
    """

    def __init__(self) -> None:
        self._start_over()

    def _start_over(self) -> None:
        self._numbers: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self._next = 0

    def __getstate__(self) -> dict[str, str]:
        # Weak references cannot be pickled, and the numbers are found again at the first step.
        return {}

    def __setstate__(self, state: dict[str, str]) -> None:
        self._start_over()

    def numbers(self, params: Sequence[torch.Tensor]) -> tuple[int, ...]:
        """The number of each parameter of a bucket, numbering those not seen before."""
        found = self._known(params)
        if found is not None:  # every step after the first: all of them seen before
            return found
        known: dict[int, int] = {}
        for p in params:
            entry = self._numbers.get(id(p))
            if entry is not None and entry[0]() is p:
                known[id(p)] = entry[1]
        new = [p for p in params if id(p) not in known]
        for p in reversed(new):
            known[id(p)] = self._next
            self._numbers[id(p)] = (weakref.ref(p), self._next)
            self._next += 1
        return tuple(known[id(p)] for p in params)

    def _known(self, params: Sequence[torch.Tensor]) -> tuple[int, ...] | None:
        """The numbers of ``params`` if every one was seen before (asked at every bucket)."""
        numbers = self._numbers
        out = []
        for p in params:
            entry = numbers.get(id(p))
            if entry is None or entry[0]() is not p:
                return None
            out.append(entry[1])
        return tuple(out)

    def number_of(self, param: torch.Tensor) -> int | None:
        """The number given to ``param``, or ``None`` if it has not been seen."""
        entry = self._numbers.get(id(param))
        return entry[1] if entry is not None and entry[0]() is param else None

    def describe(self, number: int) -> str:
        """Words for parameter ``number`` in messages, saying how it was counted."""
        return f"parameter #{number} (counted from DDP's last parameter, 0 being the last)"
