"""Factor memory of a low-rank compressor: each matrix's last factors, and which one comes next.

Power iteration approximates a gradient ``M`` (n x m) by ``P Qᵀ`` with ``P`` (n x r) and ``Q``
(m x r). Gradients change slowly from step to step, so a step that starts from the factors the
last one found (warm start) refines an approximation instead of starting from a random one.
:class:`FactorMemory` keeps those factors per key (a parameter's number, or ``"bucket<i>"``),
and, for a compressor that refines one factor a step, which one each matrix refines next.

Nothing here communicates or computes: the compressor reads and writes the factors.
"""

from collections.abc import Callable, Mapping

import torch

from commhooks._warnings import warn_once
from commhooks.compress.error_feedback import Key
from commhooks.state import StateDictError, check_tensor

__all__ = ["BOTH", "P_STEP", "Q_STEP", "FactorMemory"]

P_STEP = "p"
"""A step that refines ``P = M Q`` from the last ``Q``."""
Q_STEP = "q"
"""A step that refines ``Q = Mᵀ P`` from the last ``P``."""
BOTH = "pq"
"""A step that computes both (two rounds of communication)."""


class FactorMemory:
    """The last ``P`` and ``Q`` of each key, and the factor each key's next step refines.

    ``p`` and ``q`` are plain dicts of tensors, as PyTorch's PowerSGD state exposes them
    (``p_memory_dict``, ``q_memory_dict``). A factor is kept in the dtype and on the device of
    the gradient it approximates; one that no longer fits its gradient (a checkpoint of another
    model) is dropped with a warning, and a new random one is drawn instead.

    Args:
        owner: the name users see in warnings and errors (``"PowerSGDState"``).
        describe: turns a key into words for messages.
    """

    def __init__(self, owner: str, describe: Callable[[Key], str] = str) -> None:
        self.owner = owner
        self.describe = describe
        self.p: dict[Key, torch.Tensor] = {}
        self.q: dict[Key, torch.Tensor] = {}
        self.last_step: dict[Key, str] = {}

    def start(
        self, which: str, key: Key, shape: tuple[int, ...], like: torch.Tensor
    ) -> torch.Tensor | None:
        """The stored factor ``which`` (``"p"`` or ``"q"``) of ``key`` to start a step from.

        Returns it moved to ``like``'s dtype and device if it has ``shape``; ``None`` if there
        is none, or (with a warning, once it is dropped) if it has another shape.
        """
        store = self.p if which == P_STEP else self.q
        factor = store.get(key)
        if factor is None:
            return None
        if tuple(factor.shape) != tuple(shape):
            del store[key]
            warn_once(
                f"{self.owner}-factor-shape-{key}-{tuple(factor.shape)}-{tuple(shape)}",
                f"{self.owner}: stored warm-start factor {tuple(factor.shape)} for "
                f"{self.describe(key)} does not fit its gradient now, which needs "
                f"{tuple(shape)}; a new random factor is drawn. This happens when a checkpoint "
                "of another model is loaded.",
            )
            return None
        if factor.dtype != like.dtype or factor.device != like.device:
            factor = store[key] = factor.to(device=like.device, dtype=like.dtype)
        return factor

    def next_step(self, key: Key) -> str:
        """Which factor a one-factor-a-step compressor refines for ``key`` now: the other one
        than last time, and ``P`` first, when there is no ``P`` yet to start ``Q`` from."""
        if key in self.p and self.last_step.get(key) == P_STEP:
            return Q_STEP
        return P_STEP

    def keep(self, key: Key, p: torch.Tensor | None, q: torch.Tensor, step: str = BOTH) -> None:
        """Remember the factors a step of ``key`` ended with (not copies) and which it refined."""
        if p is not None:
            self.p[key] = p
        self.q[key] = q
        if step != BOTH:
            self.last_step[key] = step

    def drop(self, key: Key) -> bool:
        """Forget everything about ``key``; return whether there was a factor to forget."""
        self.last_step.pop(key, None)
        had_p, had_q = self.p.pop(key, None), self.q.pop(key, None)
        return had_p is not None or had_q is not None

    def state_dict(self) -> dict[str, dict[str, object]]:
        """``{"p": ..., "q": ..., "last_step": ...}`` by key as a string; factors are contiguous
        copies, so that a view into a larger buffer saves only its own elements."""
        return {
            "p": {str(k): _copy(t) for k, t in self.p.items()},
            "q": {str(k): _copy(t) for k, t in self.q.items()},
            "last_step": {str(k): v for k, v in self.last_step.items()},
        }

    def load_state_dict(
        self, state_dict: Mapping[str, object], key_of: Callable[[str], Key], prefix: str = ""
    ) -> None:
        """Replace everything by :meth:`state_dict`'s output, checked first (all or nothing).

        Args:
            state_dict: a mapping with the entries ``"p"``, ``"q"`` and ``"last_step"``.
            key_of: turns a saved key back into a key (``int`` for parameter numbers).
            prefix: put before the entries' names in messages.

        Raises:
            StateDictError: an entry that is not what :meth:`state_dict` writes: a factor that
                is not a dense, contiguous, finite 2-D floating-point tensor, a step other than
                ``"p"`` or ``"q"``, or a key that ``key_of`` refuses.
        """
        p = _factors(_entry(state_dict, "p", prefix), key_of, f"{prefix}p")
        q = _factors(_entry(state_dict, "q", prefix), key_of, f"{prefix}q")
        steps = _entries(_entry(state_dict, "last_step", prefix), key_of, f"{prefix}last_step")
        for key, step in steps.items():
            if step not in (P_STEP, Q_STEP):
                raise StateDictError(
                    f"{prefix}last_step[{str(key)!r}] must be {P_STEP!r} or {Q_STEP!r}, "
                    f"got {step!r}."
                )
        self.p, self.q = p, q
        self.last_step = {k: str(v) for k, v in steps.items()}


def _copy(factor: torch.Tensor) -> torch.Tensor:
    return factor.detach().clone(memory_format=torch.contiguous_format)


def _entry(state_dict: Mapping[str, object], name: str, prefix: str) -> object:
    if name not in state_dict:
        raise StateDictError(f"missing entry {prefix}{name!r}.")
    return state_dict[name]


def _entries(value: object, key_of: Callable[[str], Key], where: str) -> dict[Key, object]:
    if not isinstance(value, Mapping):
        raise StateDictError(f"{where} must be a mapping, got {type(value).__name__}.")
    out: dict[Key, object] = {}
    for name, entry in value.items():
        try:
            out[key_of(name)] = entry
        except (TypeError, ValueError) as exc:
            raise StateDictError(f"{where}: {name!r} is not a valid key ({exc}).") from exc
    return out


def _factors(value: object, key_of: Callable[[str], Key], where: str) -> dict[Key, torch.Tensor]:
    out: dict[Key, torch.Tensor] = {}
    for key, entry in _entries(value, key_of, where).items():
        # Earlier releases saved Q as the transpose of a contiguous Qᵀ.
        factor = check_tensor(f"{where}[{str(key)!r}]", entry, floating=True)
        if factor.dim() != 2:
            raise StateDictError(
                f"{where}[{str(key)!r}] must be a 2-D factor, got shape {tuple(factor.shape)}."
            )
        out[key] = factor
    return out
