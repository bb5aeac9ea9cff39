"""Error-feedback memory: what compression left out of each tensor, added back the next time.

A compressor that drops information keeps training unbiased over time if the part it dropped
is added to the next gradient before compressing again. :class:`ErrorFeedback` owns those
residuals, one per key (a parameter's number or name, or a chunk of a bucket)::

    memory.compensate_all_(keys, grads)             # grad += residual (before compressing)
    ... compress, communicate ...
    memory.record_where(finite, keys, grads - approx)  # the new residuals, if the step was finite

Nothing here communicates. A residual that no longer fits its tensor (a checkpoint of another
model) is dropped with a warning; a step that is not finite leaves the residuals as they were,
decided on the device, so that no NaN is ever added to a later step.
"""

import operator
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from commhooks._warnings import CommHooksWarning, warn_once
from commhooks.state import StateDictError, check_tensor

# Guards the read-modify-write of a memory's unchecked keys (see ErrorFeedback._checked); rare:
# only while loaded residuals are still to meet their first gradient.
_UNCHECKED_LOCK = threading.Lock()

__all__ = ["ErrorFeedback", "Key", "Plausible", "all_finite"]

Key = int | str
"""What a residual is kept under: a parameter's number or name, or ``"bucket<i>"``."""


Plausible = Callable[[torch.Tensor, torch.Tensor], bool]
"""``plausible(residual, gradient)``: whether compressing such a gradient can have dropped that
much (each compressor's ``plausible_residual``)."""


class ErrorFeedback:
    """Residuals per key, added back before compressing.

    A loaded residual is finite (checked at load) but may still be absurd: 1e6 added to
    gradients of 1e-2 would wreck training on every rank. Given ``plausible``, each is compared
    once with the first gradient it meets (:meth:`check_loaded_`) and reset with a warning if
    compression could not have dropped that much; later steps check nothing, so never wait.

    Args:
        owner: the name users see in warnings and errors (``"PowerSGDState"``...).
        describe: turns a key into words for messages (``parameter #3 (...)``).
        plausible: the compressor's bound on its residuals; ``None``: loaded ones are trusted.
    """

    _unchecked: frozenset[Key] = frozenset()  # loaded keys still to meet their gradient
    _checks_from: int | None = None  # the owner's step at which they first met gradients

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
        """The residual of ``key`` moved to ``like``'s dtype and device; ``None`` if there is
        none, or (dropped, with a warning: it was made for another tensor) of another shape."""
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
            self._unchecked, self._checks_from = frozenset(self._residuals), None

    @property
    def awaits_check(self) -> bool:
        """Whether loaded residuals are still to meet their gradient (no device work)."""
        return bool(self._unchecked)

    def _checked(self, key: Key) -> None:
        """``key`` no longer awaits its check. Under a lock: DDP's thread and the issuer's
        threads both take keys out, and a lost update would put one back."""
        with _UNCHECKED_LOCK:
            self._unchecked = self._unchecked - {key}

    def check_loaded_(self, key: Key, gradient: torch.Tensor) -> None:
        """The first time a loaded residual of ``key`` meets ``gradient``, reset it with a
        warning if the compressor could not have dropped that much: one host wait a loaded key,
        once."""
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

    def forget_unmet(self, step: int) -> list[Key]:
        """Called at each use with the owner's step count: once a whole step has passed since
        loaded residuals first met gradients, drop with a warning those that met none, and
        return their keys. They belong to no tensor compressed now (a layer frozen since the
        save, another model's file); kept, they would be saved again in every checkpoint, and
        while any awaits its check every use looks each key up."""
        if not self._unchecked:
            return []
        if self._checks_from is None:
            self._checks_from = step
            return []
        if step <= self._checks_from + 1:  # (the owner counts a step at its last bucket)
            return []
        with _UNCHECKED_LOCK:
            unmet, self._unchecked = sorted(self._unchecked, key=str), frozenset()
        for key in unmet:
            self._residuals.pop(key, None)
        more = f" and {len(unmet) - 1} more" if len(unmet) > 1 else ""
        warnings.warn(
            f"{self.owner}: {len(unmet)} loaded error-feedback memor{_plural(len(unmet))} met no "
            f"gradient in a whole step ({self.describe(unmet[0])}{more}; keys {unmet}): nothing "
            "compressed here has them (a layer frozen since the checkpoint, or another "
            "model's file). They were dropped.",
            CommHooksWarning,
            stacklevel=3,
        )
        return unmet

    def compensate_all_(self, keys: Sequence[Key], tensors: Sequence[torch.Tensor]) -> list[bool]:
        """``tensor += residual`` for each pair, in one batched addition (a bucket holds many
        small tensors); whether each had a residual. Loaded ones are checked first."""
        if self._unchecked:
            for key, tensor in zip(keys, tensors):
                self.check_loaded_(key, tensor)
        residuals = [self.get(key, tensor) for key, tensor in zip(keys, tensors)]
        pairs = [(t, r) for t, r in zip(tensors, residuals) if r is not None]
        if pairs:
            torch._foreach_add_([t for t, _ in pairs], [r for _, r in pairs])
        return [r is not None for r in residuals]

    def record_where(
        self, finite: torch.Tensor, keys: Sequence[Key], errors: Sequence[torch.Tensor]
    ) -> None:
        """Keep each of ``errors`` as its key's residual, in place, where ``finite`` (a boolean
        tensor on their device) is true; else the residual as it was (zeros for a key without
        one). Decided on the device: nothing is read back."""
        for key, error in zip(keys, errors):
            if self._unchecked:  # a new residual, or the old one kept: checked either way
                self._checked(key)
            old = self._residuals.get(key)
            if old is None or not _fits(old, error):
                old = self._residuals[key] = torch.zeros_like(error)
            _take_where(finite, error, old)

    def record(self, key: Key, residual: torch.Tensor) -> None:
        """Keep ``residual`` (not a copy) as what compression left out of ``key``."""
        if self._unchecked:
            self._checked(key)
        self._residuals[key] = residual

    def record_all(self, keys: Sequence[Key], residuals: Sequence[torch.Tensor]) -> None:
        """:meth:`record` each key's residual; one dict update where none awaits its check."""
        if self._unchecked:
            for key, residual in zip(keys, residuals):
                self.record(key, residual)
            return
        self._residuals.update(zip(keys, residuals))

    def holds(self, keys: Sequence[Key], residuals: Sequence[torch.Tensor]) -> bool:
        """Whether the residual kept for each key is that very tensor (and none awaits its
        check): a caller that recorded its own buffers need neither look them up nor copy."""
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

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Each residual by its key as a string; copies, so a view saves only its own elements."""
        return {str(k): t.detach().clone() for k, t in self._residuals.items()}

    def load_state_dict(
        self, state_dict: Mapping[str, object], key_of: Callable[[str], Key], where: str
    ) -> None:
        """Replace every residual by those of ``state_dict``, checked first (all or nothing):
        ``key_of`` turns a saved key back into a key, ``where`` names the entry in errors.

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


def _plural(count: int) -> str:
    return "y" if count == 1 else "ies"


_BITWISE_FROM = 1 << 16  # elements
_BITS = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def _take_where(finite: torch.Tensor, new: torch.Tensor, into: torch.Tensor) -> None:
    """``into`` becomes ``new`` where ``finite`` is true, else stays as it was.

    A GPU's ``torch.where`` is one pass. A CPU's runs a scalar loop, about five times a copy's
    time, where a residual the size of the gradients costs more than the step's products: there
    the same choice is made on the bits in place (``into ^ new``, kept only where not finite,
    then ``^ new`` again), three vectorised passes that give every value exactly, inf, NaN and
    the sign of zero included. A small tensor keeps ``torch.where``: there what counts is
    the number of operations dispatched, and one is fewer than three.
    """
    bits = _BITS.get(into.dtype)
    cpu = into.device.type == "cpu" and into.numel() >= _BITWISE_FROM
    if not cpu or bits is None or new.dtype != into.dtype or new.data_ptr() == into.data_ptr():
        torch.where(finite, new, into, out=into)
        return
    word, other = into.view(bits), new.view(bits)
    word.bitwise_xor_(other).bitwise_and_(finite.logical_not().to(bits).neg_())
    word.bitwise_xor_(other)


def _fits(kept: torch.Tensor, like: torch.Tensor) -> bool:
    return (kept.shape, kept.dtype, kept.device) == (like.shape, like.dtype, like.device)


def all_finite(*tensors: torch.Tensor) -> torch.Tensor:
    """Whether every element of ``tensors`` is finite, as a boolean tensor on their device
    (for :meth:`ErrorFeedback.record_where`; never read back).

    From their total, one reduction each (half precision summed in float32): inf or NaN
    anywhere makes it non-finite, and so does a total past float32's range, a step then kept
    out of the memories too.
    """
    total = _total(tensors[0])
    for tensor in tensors[1:]:
        total = total + _total(tensor)
    gap = total - total  # NaN exactly where the total is inf or NaN, 0 elsewhere
    return gap == gap  # two operations between tensors: no scalar to convert, no read


def _total(tensor: torch.Tensor) -> torch.Tensor:
    wide = torch.float32 if tensor.dtype in (torch.float16, torch.bfloat16) else None
    return tensor.sum(dtype=wide)
