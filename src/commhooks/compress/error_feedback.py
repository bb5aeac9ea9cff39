"""Error-feedback memory: what compression left out of each tensor, added back the next time.

A compressor that drops information (a low-rank approximation, a quantisation) keeps training
unbiased over time if the part it dropped is remembered and added to the next gradient before
compressing again. :class:`ErrorFeedback` owns those residuals, one per key (a parameter's
number or name, or a chunk of a bucket). A compressing step uses it in this order::

    memory.compensate_(key, grad)        # grad += residual    (before compressing)
    ... compress, communicate ...
    memory.record(key, grad - approx)    # the new residual    (or write into memory.slot)
    memory.withdraw_(key, grad)          # grad -= residual    (instead, on an abandoned step)

Nothing here communicates. Residuals are kept in the dtype and on the device of the tensors they
correct; a residual that no longer fits its tensor (a checkpoint of another model) is dropped
with a warning, and a residual that is not finite is never kept: one NaN would otherwise be
added to every later step.

:class:`LazyErrorFeedback` is the same memory for a low-rank compressor that adds each gradient
into the memory (rather than the memory into the gradient) and subtracts the approximations it
sends some steps later, in a pass it makes anyway (PowerSGD's single-round variant).
"""

import operator
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from commhooks import _reads
from commhooks._warnings import CommHooksWarning, warn_once
from commhooks.compress import lowrank
from commhooks.state import StateDictError, check_tensor

# Guards the read-modify-write of a memory's unchecked keys (see ErrorFeedback._checked); rare:
# only while loaded residuals are still to meet their first gradient.
_UNCHECKED_LOCK = threading.Lock()

__all__ = ["Absorbed", "ErrorFeedback", "Key", "LazyErrorFeedback", "Plausible", "mark_non_finite_"]

Key = int | str
"""What a residual is kept under: a parameter's number or name, or ``"bucket<i>"``."""


Plausible = Callable[[torch.Tensor, torch.Tensor], bool]
"""``plausible(residual, gradient)``: whether a residual can be what compressing a gradient of
that size dropped. Each compressor bounds its own residuals (see the ``plausible_residual`` of
:mod:`commhooks.compress.blocks` and of :mod:`commhooks.compress.lowrank`)."""


class ErrorFeedback:
    """Residuals per key, added back before compressing.

    A residual loaded from a state dict is finite (checked at load) but may still be absurd: a
    memory filled with 1e6 would be added to gradients of 1e-2 and wreck training on every
    rank. Given ``plausible``, each loaded residual is compared once, the first time it meets
    the gradient it is added to (:meth:`check_loaded_`, which :meth:`compensate_` calls), and
    reset with a warning naming its key if compression could not have dropped that much. Only
    then: steps after that make no check, and so no host-device synchronisation.

    Args:
        owner: the name users see in warnings and errors (``"PowerSGDState"``...).
        describe: turns a key into words for messages (``parameter #3 (...)``).
        plausible: the compressor's bound on its residuals; ``None``: loaded ones are trusted.
    """

    # Class-level defaults, so that a memory pickled before these existed still works.
    _plausible: Plausible | None = None
    _unchecked: frozenset[Key] = frozenset()

    def __init__(
        self,
        owner: str,
        describe: Callable[[Key], str] = str,
        plausible: Plausible | None = None,
    ) -> None:
        self.owner = owner
        self.describe = describe
        self._residuals: dict[Key, torch.Tensor] = {}
        self._plausible = plausible

    def __contains__(self, key: object) -> bool:
        return key in self._residuals

    def __len__(self) -> int:
        return len(self._residuals)

    def __iter__(self) -> Iterator[Key]:
        return iter(self._residuals)

    def items(self) -> list[tuple[Key, torch.Tensor]]:
        """``(key, residual)`` pairs, residuals as stored (not copies)."""
        return list(self._residuals.items())

    def get(self, key: Key, like: torch.Tensor) -> torch.Tensor | None:
        """The residual of ``key`` if it fits ``like`` (moved to its dtype and device), else None.

        A residual of another shape is dropped with a warning: it was made for another tensor.
        """
        residual = self._residuals.get(key)
        if residual is None:
            return None
        if residual.shape != like.shape:
            del self._residuals[key]
            warn_once(
                f"{self.owner}-memory-shape-{key}-{tuple(residual.shape)}-{tuple(like.shape)}",
                f"{self.owner}: stored error-feedback memory {tuple(residual.shape)} for "
                f"{self.describe(key)} does not fit its gradient now {tuple(like.shape)}; it was "
                "reset to zero. This happens when a checkpoint of another model is loaded.",
            )
            return None
        if residual.dtype != like.dtype or residual.device != like.device:
            residual = self._residuals[key] = residual.to(device=like.device, dtype=like.dtype)
        return residual

    def check_before_use(self) -> None:
        """Check every residual held now at its next use, as if just loaded (an unpickled
        state's memory came from a file too)."""
        if self._plausible is not None:
            self._unchecked = frozenset(self._residuals)

    @property
    def awaits_check(self) -> bool:
        """Whether loaded residuals are still to meet their gradient (see
        :meth:`check_loaded_`). A plain attribute test: no device work."""
        return bool(self._unchecked)

    def _checked(self, key: Key) -> None:
        """``key`` no longer awaits its check. Under a lock: DDP's thread and the issuer's
        threads both take keys out, and a lost update would put one back."""
        with _UNCHECKED_LOCK:
            self._unchecked = self._unchecked - {key}

    def check_loaded_(self, key: Key, gradient: torch.Tensor) -> None:
        """The first time a loaded residual of ``key`` meets ``gradient`` (what it is added
        to), reset it with a warning if the compressor could not have dropped that much.

        Costs one reduction and host synchronisation per loaded key, once; nothing for keys
        recorded since the load.
        """
        if key not in self._unchecked:
            return
        self._checked(key)
        residual = self._residuals.get(key)
        check = self._plausible
        if residual is None or check is None or check(residual, gradient.detach()):
            return
        self.discard(key)
        warnings.warn(  # once per loaded memory, so not once per process
            f"{self.owner}: the loaded error-feedback memory of {self.describe(key)} (key "
            f"{str(key)!r}) is out of all proportion with the gradient it is added to (largest "
            f"element {float(residual.abs().max()):.3g}, the gradient's "
            f"{float(gradient.abs().max()):.3g}): compression never drops that much. It was "
            "reset to zero rather than added to the average. Check the checkpoint it came from.",
            CommHooksWarning,
            stacklevel=3,
        )

    def compensate_(self, key: Key, tensor: torch.Tensor) -> bool:
        """``tensor += residual`` in place; returns whether there was a residual to add.

        The first time after a load, the residual is checked against ``tensor`` first (see
        :meth:`check_loaded_`).
        """
        if self._unchecked:
            self.check_loaded_(key, tensor)
        residual = self.get(key, tensor)
        if residual is None:
            return False
        tensor.add_(residual)
        return True

    def compensate_all_(self, keys: Sequence[Key], tensors: Sequence[torch.Tensor]) -> list[bool]:
        """:meth:`compensate_` of each ``(key, tensor)`` pair; returns whether each had a residual.

        A bucket holds many small tensors: their additions are one batched call (the same
        elementwise sums), so a step pays one operation here rather than one per tensor.
        """
        if self._unchecked:
            for key, tensor in zip(keys, tensors):
                self.check_loaded_(key, tensor)
        residuals = [self.get(key, tensor) for key, tensor in zip(keys, tensors)]
        pairs = [(t, r) for t, r in zip(tensors, residuals) if r is not None]
        if pairs:
            torch._foreach_add_([t for t, _ in pairs], [r for _, r in pairs])
        return [r is not None for r in residuals]

    def withdraw_(self, key: Key, tensor: torch.Tensor) -> None:
        """Undo :meth:`compensate_`: ``tensor -= residual`` (a step abandoned before recording).

        Where the residual is not finite, ``tensor + residual`` lost the tensor's value: it is
        set to zero there, and the residual is dropped with a warning rather than added to the
        next gradient. Checking costs a pass over the residual, on abandoned steps only.
        """
        residual = self._residuals.get(key)
        if residual is None or residual.shape != tensor.shape:
            return
        finite = torch.isfinite(residual)
        if bool(finite.all()):
            tensor.sub_(residual)
            return
        tensor.sub_(residual.where(finite, 0.0)).masked_fill_(~finite, 0.0)
        self._forget_non_finite([key])

    def slot(self, key: Key, like: torch.Tensor) -> torch.Tensor:
        """Storage to write the next residual of ``key`` into: the old one's, if it fits.

        The memory keeps the returned tensor as the residual of ``key``; write it completely.
        """
        if self._unchecked:  # overwritten whole: a new residual
            self._checked(key)
        residual = self._residuals.get(key)
        if (
            residual is None
            or residual.shape != like.shape
            or residual.dtype != like.dtype
            or residual.device != like.device
        ):
            residual = self._residuals[key] = torch.empty_like(like)
        return residual

    def slots(self, keys: Sequence[Key], likes: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """:meth:`slot` of each key: where a step writes the new residuals of all its tensors."""
        return [self.slot(key, like) for key, like in zip(keys, likes)]

    def record(self, key: Key, residual: torch.Tensor) -> None:
        """Keep ``residual`` (not a copy) as what compression left out of ``key``."""
        if self._unchecked:
            self._checked(key)
        self._residuals[key] = residual

    def record_all(self, keys: Sequence[Key], residuals: Sequence[torch.Tensor]) -> None:
        """:meth:`record` each key's residual: in one update where no loaded residual awaits
        its check (a step's usual case: no Python call per key, which a GPU's host pays)."""
        if self._unchecked:
            for key, residual in zip(keys, residuals):
                self.record(key, residual)
            return
        self._residuals.update(zip(keys, residuals))

    def holds(self, keys: Sequence[Key], residuals: Sequence[torch.Tensor]) -> bool:
        """Whether the residual kept for each key is that very tensor (and none awaits its
        check): a caller that recorded its own buffers finds them where it left them, and
        need neither look each one up nor copy it (compared without a Python call per key)."""
        if self._unchecked:
            return False
        found = map(self._residuals.get, keys)
        return len(keys) == len(residuals) and all(map(operator.is_, found, residuals))

    def discard(self, key: Key) -> None:
        """Forget the residual of ``key`` (its next gradient is compressed as it is)."""
        if self._unchecked:
            self._checked(key)
        self._residuals.pop(key, None)

    def clear(self) -> None:
        """Forget every residual."""
        self._unchecked = frozenset()
        self._residuals.clear()

    def drop_non_finite(self, keys: Iterable[Key] | None = None) -> list[Key]:
        """Forget every residual holding inf or NaN, with a warning; return their keys.

        Such a residual, added to every later gradient, would make every later step non-finite.
        ``keys`` limits the check to those residuals (the ones a step used), so that the
        residuals of steps still in flight are left alone.
        """
        chosen = self._residuals if keys is None else [k for k in keys if k in self._residuals]
        bad = [k for k in chosen if not bool(torch.isfinite(self._residuals[k]).all())]
        self._forget_non_finite(bad)
        return bad

    def _forget_non_finite(self, bad: list[Key]) -> None:
        for key in bad:
            self.discard(key)
        if bad:
            names = ", ".join(self.describe(k) for k in bad[:4]) + (" ..." if len(bad) > 4 else "")
            warn_once(
                f"{self.owner}-memory-non-finite-{bad[0]}",
                f"{self.owner}: the error-feedback memory of {names} held inf or NaN and was reset "
                "to zero rather than added to the next gradient.",
            )

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Each residual by its key as a string; copies, so a view saves only its own elements."""
        return {str(k): t.detach().clone() for k, t in self._residuals.items()}

    def load_state_dict(
        self, state_dict: Mapping[str, object], key_of: Callable[[str], Key], where: str
    ) -> None:
        """Replace every residual by those of ``state_dict``, checked first (all or nothing).

        Args:
            state_dict: :meth:`state_dict`'s output.
            key_of: turns a saved key back into a key (``int`` for parameter numbers).
            where: names the entry in error messages, e.g. ``"PowerSGDState 'error'"``.

        Raises:
            StateDictError: a key or tensor that is not what :meth:`state_dict` writes.
        """
        if not isinstance(state_dict, Mapping):
            raise StateDictError(
                f"{where} must be a mapping of keys to tensors, got {type(state_dict).__name__}."
            )
        loaded: dict[Key, torch.Tensor] = {}
        for name, value in state_dict.items():
            try:
                key = key_of(name)
            except (TypeError, ValueError) as exc:
                raise StateDictError(f"{where}: {name!r} is not a valid key ({exc}).") from exc
            loaded[key] = check_tensor(f"{where}[{name!r}]", value, floating=True)
        self._residuals, self._unchecked = loaded, frozenset()
        self.check_before_use()


def mark_non_finite_(gradients: Sequence[torch.Tensor], sent: torch.Tensor) -> None:
    """Make ``sent`` NaN if any of ``gradients`` holds inf or NaN, on the device.

    Their total, times 0, is NaN exactly then (or if finite values sum past float32's range,
    which only sends the bucket as plain allreduce), and 0 otherwise: one reduction of each
    gradient (one multi-tensor kernel for many on a GPU) and one addition, where an elementwise
    test took five passes over each matrix and two matrices of scratch, and nothing is read
    back. ``sent`` may hold the factors of many matrices: a bucket falls back as a whole when
    any of its sums is not finite, so marking all of them for one gradient decides the same.
    """
    if len(gradients) == 1:
        total = gradients[0].sum(dtype=torch.float32)
    else:
        totals = torch._foreach_norm(list(gradients), 1, dtype=torch.float32)
        total = torch.stack(totals).sum()
    sent.add_(total.mul_(0.0))


@dataclass
class Absorbed:
    """What :meth:`LazyErrorFeedback.absorb_` changed, so that :meth:`~LazyErrorFeedback.roll_back_`
    can take it out again if the step is abandoned."""

    key: Key
    gradient: torch.Tensor
    memory: torch.Tensor
    created: bool  # the memory was made for this step
    folded: tuple[torch.Tensor, torch.Tensor] | None  # pending products subtracted in the pass
    written: int  # rows of the memory that now hold the gradient added


class LazyErrorFeedback(ErrorFeedback):
    """Error feedback for a low-rank compressor that sends a factor of ``memory + gradient``.

    PowerSGD's single-round variant adds each gradient into the memory and sends one factor of
    the sum (:meth:`absorb_`); the new residual is that sum minus the approximation ``P Qᵀ``
    received. Subtracting ``P Qᵀ`` at once would cost a pass over the memory after the
    collective, so the memory keeps it as a *pending product* instead (:meth:`defer_`): later
    factors are corrected for it on their thin results, and it is taken out in the pass of a
    later :meth:`absorb_`, once the pending products reach rank :attr:`max_pending_rank`.
    A matrix small enough that the pass costs less than that bookkeeping has ``P Qᵀ``
    subtracted at once instead (:meth:`subtract_`).

    Everything else sees plain residuals: :meth:`get`, :meth:`items`, :meth:`compensate_`,
    :meth:`state_dict` and the others first subtract what is pending from the residuals they
    touch, in place.
    """

    max_pending_rank = 16
    """Products are subtracted once they would stack up past this rank: one wider product a
    few steps apart costs less than a thin one every step."""

    def __init__(
        self,
        owner: str,
        describe: Callable[[Key], str] = str,
        plausible: Plausible | None = None,
    ) -> None:
        super().__init__(owner, describe, plausible)
        self._pending: dict[Key, tuple[torch.Tensor, torch.Tensor]] = {}

    def pending_ranks(self) -> dict[Key, int]:
        """The rank of the products still to subtract, per key that has any."""
        return {key: p.shape[1] for key, (p, _) in self._pending.items()}

    # -- plain residuals for everyone else ---------------------------------------------------
    def get(self, key: Key, like: torch.Tensor) -> torch.Tensor | None:
        if key in self._pending:
            self._materialize(key)
        return super().get(key, like)

    def items(self) -> list[tuple[Key, torch.Tensor]]:
        for key in list(self._pending):
            self._materialize(key)
        return super().items()

    def withdraw_(self, key: Key, tensor: torch.Tensor) -> None:
        self._materialize(key)
        super().withdraw_(key, tensor)

    def slot(self, key: Key, like: torch.Tensor) -> torch.Tensor:
        self._pending.pop(key, None)  # the slot is overwritten whole
        return super().slot(key, like)

    def record(self, key: Key, residual: torch.Tensor) -> None:
        self._pending.pop(key, None)
        super().record(key, residual)

    def record_all(self, keys: Sequence[Key], residuals: Sequence[torch.Tensor]) -> None:
        for key, residual in zip(keys, residuals):
            self.record(key, residual)

    def holds(self, keys: Sequence[Key], residuals: Sequence[torch.Tensor]) -> bool:
        # A pending product is part of the residual: only plain ones are where they were left.
        return not any(key in self._pending for key in keys) and super().holds(keys, residuals)

    def discard(self, key: Key) -> None:
        self._pending.pop(key, None)
        super().discard(key)

    def clear(self) -> None:
        self._pending.clear()
        super().clear()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """As :meth:`ErrorFeedback.state_dict`; first subtracts the pending products, in place,
        so that training on from here and from the saved dict run the same steps."""
        self.items()
        return super().state_dict()

    def load_state_dict(
        self, state_dict: Mapping[str, object], key_of: Callable[[str], Key], where: str
    ) -> None:
        super().load_state_dict(state_dict, key_of, where)
        self._pending.clear()

    # -- the single-round step ---------------------------------------------------------------
    def absorb_(
        self,
        key: Key,
        gradient: torch.Tensor,
        known: torch.Tensor,
        sent: torch.Tensor,
        refine_q: bool,
        scratch: torch.Tensor,
        finite: bool = False,
        mark: bool = True,
    ) -> Absorbed:
        """``memory += gradient`` and ``sent`` = the factor of the memory, in one pass.

        ``refine_q`` chooses the factor: ``Q = memoryᵀ P`` from ``known = P`` (n x r), or else
        ``P = memory Q`` from ``known = Q`` (m x r); ``sent`` is (m x r) or (n x r), with
        pending products accounted for. If ``gradient`` is not finite, neither is ``sent``, and
        its non-finite part never enters the memory: on CPU a block that is not finite is not
        added, nor any after it (one sum read back per block); on a GPU, where reading back
        would stall the stream, non-finite elements are added as zeros. ``finite`` says the
        caller found ``gradient`` finite already: it is not checked again. ``mark=False`` leaves
        marking ``sent`` to the caller (:func:`mark_non_finite_`, once for many matrices).
        """
        memory, pending, created, folds = self._prepared(key, gradient, known.shape[1])
        folded = pending if folds else None
        check = _reads.are_free(memory)  # a fused pass reads a sum back a block: CPU only
        if refine_q:
            args = (memory, gradient, folded, known, sent.t(), scratch, check, finite)
            written = lowrank.accumulate_right_factor_(*args)
            if pending is not None and not folds:
                lowrank.deduct_pending_right_(sent.t(), pending, known)
        else:
            args = (memory, gradient, folded, known.t(), sent, scratch, check, finite)
            written = lowrank.accumulate_left_factor_(*args)
            if pending is not None and not folds:
                lowrank.deduct_pending_left_(sent, pending, known.t())
        if not check and mark:
            mark_non_finite_([gradient], sent)
        if folds:
            del self._pending[key]  # now in the memory (roll_back_ restores that)
        return Absorbed(key, gradient, memory, created, folded, written)

    def _prepared(
        self, key: Key, gradient: torch.Tensor, rank: int
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None, bool, bool]:
        """What absorbing ``gradient`` into ``key``'s memory starts from: the memory (made
        zero if new; a loaded one checked at its first use), its pending products, whether it
        was made now, and whether the pending products fold into it (their rank and ``rank``
        past :attr:`max_pending_rank`)."""
        if self._unchecked:
            self.check_loaded_(key, gradient)
        memory = super().get(key, gradient)  # as it is, pending products included
        pending = self._fitting_pending(key)
        created = memory is None
        if memory is None:
            memory = torch.zeros_like(gradient)
            super().record(key, memory)
        folds = pending is not None and pending[0].shape[1] + rank > self.max_pending_rank
        return memory, pending, created, folds

    def absorb_all_(
        self,
        steps: Sequence[tuple[Key, torch.Tensor, torch.Tensor, torch.Tensor]],
        refine_q: Sequence[bool],
        scratch: torch.Tensor,
        finite: bool = False,
        sent_in: torch.Tensor | None = None,
        stacks: Sequence[torch.Tensor] | None = None,
    ) -> list[Absorbed]:
        """:meth:`absorb_` of each ``(key, gradient, known, sent)``, refining ``Q`` where
        ``refine_q`` says so: a bucket's matrices alone, in one call to the memory. ``finite``:
        the caller found every gradient finite (one check for them all). ``sent_in``: a tensor
        that holds every ``sent`` (the flat buffer they are views of); where gradients are
        checked on the device (a GPU) it is marked once for all of them
        (:func:`mark_non_finite_`) instead of each ``sent`` on its own. ``stacks``: the
        gradients again, as ``(count, n, m)`` stacks that hold them in order (a run of
        matrices at one stride is one view); where given, that branch zeroes their
        non-finite elements and checks them a stack at a time, not a matrix at a time.

        Finite gradients small enough for :func:`lowrank.accumulates_together` are absorbed
        together (:meth:`_absorb_together`): the same bits, a few operations per matrix
        instead of a dozen.
        """
        if finite and lowrank.accumulates_together([step[1] for step in steps]):
            return self._absorb_together(steps, refine_q)
        if sent_in is not None and not finite and len(steps) > 1 and not _reads.are_free(sent_in):
            # A GPU's branch: whole matrices, checked on the device; all the factors are
            # marked at once.
            cleaned = None if stacks is None else lowrank.finite_parts(stacks)
            absorbed = self._absorb_together(steps, refine_q, checked=False, cleaned=cleaned)
            mark_non_finite_(stacks or [step[1] for step in steps], sent_in)
            return absorbed
        return [
            self.absorb_(key, gradient, known, sent, refines, scratch, finite)
            for (key, gradient, known, sent), refines in zip(steps, refine_q)
        ]

    def _absorb_together(
        self,
        steps: Sequence[tuple[Key, torch.Tensor, torch.Tensor, torch.Tensor]],
        refine_q: Sequence[bool],
        checked: bool = True,
        cleaned: Sequence[torch.Tensor] | None = None,
    ) -> list[Absorbed]:
        """:meth:`absorb_` of many gradients, their passes made by one call to the compressor:
        :func:`lowrank.accumulate_factors_` for finite ones on a CPU (``checked``), or
        :func:`lowrank.accumulate_whole_factors_` on a GPU's branch, which adds non-finite
        elements as zeros (those of ``cleaned``, where the caller zeroed them); the memories'
        bookkeeping is :meth:`absorb_`'s."""
        absorbed: list[Absorbed] = []
        passes: list[lowrank.AccumulatePass] = []
        for (key, gradient, known, sent), refines in zip(steps, refine_q):
            memory, pending, created, folds = self._prepared(key, gradient, known.shape[1])
            if folds:
                del self._pending[key]  # now in the memory (roll_back_ restores that)
            passes.append((memory, gradient, pending, folds, known, sent, refines))
            folded = pending if folds else None
            absorbed.append(Absorbed(key, gradient, memory, created, folded, memory.shape[0]))
        if checked:
            lowrank.accumulate_factors_(passes)
        else:
            lowrank.accumulate_whole_factors_(passes, cleaned)
        return absorbed

    def defer_all_(self, products: Sequence[tuple[Key, torch.Tensor, torch.Tensor]]) -> None:
        """:meth:`defer_` of each ``(key, P, Qᵀ)``."""
        for key, p, qt in products:
            self.defer_(key, p, qt)

    def defer_(self, key: Key, p: torch.Tensor, qt: torch.Tensor) -> None:
        """The step of :meth:`absorb_` completed and sent ``P Qᵀ``: it joins the products that
        are still to subtract from the memory of ``key``."""
        if key not in self:
            return
        old = self._pending.get(key)
        if old is None:
            self._pending[key] = (p.clone(), qt.clone())
        else:
            self._pending[key] = (torch.cat([old[0], p], 1), torch.cat([old[1], qt], 0))

    def subtract_(self, products: Sequence[tuple[Key, torch.Tensor]]) -> None:
        """The step of :meth:`absorb_` completed and sent ``P Qᵀ``, already formed in each
        ``(key, product)``: it leaves the memory of ``key`` now, with any product pending there.

        For a small matrix a pending product saves a pass that costs next to nothing, and
        keeping it costs a few operations a step (the concatenation that stacks it, the
        correction of every later factor); here a bucket's small matrices take one batched
        subtraction instead (:func:`lowrank.fits_one_block` says which).
        """
        memories: list[torch.Tensor] = []
        formed: list[torch.Tensor] = []
        for key, product in products:
            if key not in self:
                continue
            if key in self._pending:
                self._materialize(key)
            memories.append(self._residuals[key])
            formed.append(product)
        if memories:
            torch._foreach_sub_(memories, formed)

    def roll_back_(self, absorbed: Absorbed) -> None:
        """Take out what :meth:`absorb_` added: the step was abandoned.

        The memory is the previous one again, to the rounding of one addition, with the
        products that step folded in subtracted everywhere. A memory that is not finite then
        (it was not before, or the addition overflowed) is reset with a warning.
        """
        key, memory, written = absorbed.key, absorbed.memory, absorbed.written
        if absorbed.created:
            super().discard(key)
            return
        added = absorbed.gradient[:written].nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        memory[:written].sub_(added)
        if absorbed.folded is not None and written < memory.shape[0]:
            p0, q0t = absorbed.folded
            lowrank.subtract_product_(memory[written:], p0[written:], q0t)
        self.drop_non_finite([key])  # pending products are finite: the residual decides

    def abandon_(
        self, withdrawn: Sequence[tuple[Key, torch.Tensor]], absorbed: Sequence[Absorbed]
    ) -> None:
        """Undo a whole abandoned step: :meth:`withdraw_` each compensated ``(key, tensor)``,
        :meth:`roll_back_` each absorbed gradient; the memory is as it was before the step."""
        for key, tensor in withdrawn:
            self.withdraw_(key, tensor)
        for each in absorbed:
            self.roll_back_(each)

    # -- pending products --------------------------------------------------------------------
    def _fitting_pending(self, key: Key) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The products pending on ``key`` as ``(P, Qᵀ)`` in the memory's dtype and device.

        Products that no longer fit the memory (it was reset, or replaced by one of another
        shape) are dropped.
        """
        pending = self._pending.get(key)
        if pending is None:
            return None
        memory = self._residuals.get(key)
        p, qt = pending
        if memory is None or memory.dim() != 2 or (p.shape[0], qt.shape[1]) != memory.shape:
            del self._pending[key]
            return None
        if p.dtype != memory.dtype or p.device != memory.device:
            p, qt = p.to(memory), qt.to(memory)
        return p, qt

    def _materialize(self, key: Key) -> None:
        pending = self._fitting_pending(key)
        if pending is not None:
            lowrank.subtract_product_(self._residuals[key], *pending)
        self._pending.pop(key, None)
