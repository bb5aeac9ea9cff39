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
"""

from collections.abc import Callable, Iterator, Mapping

import torch

from commhooks._warnings import warn_once
from commhooks.state import StateDictError, check_tensor

__all__ = ["ErrorFeedback", "Key"]

Key = int | str
"""What a residual is kept under: a parameter's number or name, or ``"bucket<i>"``."""


class ErrorFeedback:
    """Residuals per key, added back before compressing.

    Args:
        owner: the name users see in warnings and errors (``"PowerSGDState"``...).
        describe: turns a key into words for messages (``parameter #3 (...)``).
    """

    def __init__(self, owner: str, describe: Callable[[Key], str] = str) -> None:
        self.owner = owner
        self.describe = describe
        self._residuals: dict[Key, torch.Tensor] = {}

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
                f"{self.owner}: the error-feedback memory {tuple(residual.shape)} of "
                f"{self.describe(key)} does not fit its tensor {tuple(like.shape)}; it was reset "
                "to zero. This happens when a checkpoint of another model is loaded.",
            )
            return None
        if residual.dtype != like.dtype or residual.device != like.device:
            residual = self._residuals[key] = residual.to(device=like.device, dtype=like.dtype)
        return residual

    def compensate_(self, key: Key, tensor: torch.Tensor) -> bool:
        """``tensor += residual`` in place; returns whether there was a residual to add."""
        residual = self.get(key, tensor)
        if residual is None:
            return False
        tensor.add_(residual)
        return True

    def withdraw_(self, key: Key, tensor: torch.Tensor) -> None:
        """Undo :meth:`compensate_`: ``tensor -= residual`` (a step abandoned before recording)."""
        residual = self._residuals.get(key)
        if residual is not None and residual.shape == tensor.shape:
            tensor.sub_(residual)

    def slot(self, key: Key, like: torch.Tensor) -> torch.Tensor:
        """Storage to write the next residual of ``key`` into: the old one's, if it fits.

        The memory keeps the returned tensor as the residual of ``key``; write it completely.
        """
        residual = self._residuals.get(key)
        if (
            residual is None
            or residual.shape != like.shape
            or residual.dtype != like.dtype
            or residual.device != like.device
        ):
            residual = self._residuals[key] = torch.empty_like(like)
        return residual

    def record(self, key: Key, residual: torch.Tensor) -> None:
        """Keep ``residual`` (not a copy) as what compression left out of ``key``."""
        self._residuals[key] = residual

    def discard(self, key: Key) -> None:
        """Forget the residual of ``key`` (its next gradient is compressed as it is)."""
        self._residuals.pop(key, None)

    def clear(self) -> None:
        """Forget every residual."""
        self._residuals.clear()

    def drop_non_finite(self) -> list[Key]:
        """Forget every residual holding inf or NaN, with a warning; return their keys.

        Such a residual, added to every later gradient, would make every later step non-finite.
        """
        bad = [k for k, t in self._residuals.items() if not bool(torch.isfinite(t).all())]
        for key in bad:
            del self._residuals[key]
        if bad:
            names = ", ".join(self.describe(k) for k in bad[:4]) + (" ..." if len(bad) > 4 else "")
            warn_once(
                f"{self.owner}-memory-non-finite-{bad[0]}",
                f"{self.owner}: the error-feedback memory of {names} held inf or NaN and was reset "
                "to zero rather than added to the next gradient.",
            )
        return bad

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
        self._residuals = loaded
