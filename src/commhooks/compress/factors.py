"""Factor memory of a low-rank compressor: each matrix's last factors, and which one comes next.

Gradients change slowly, so a power iteration that starts from the factors ``P`` (n x r) and
``Q`` (m x r) of the last step (warm start) refines an approximation ``P Qᵀ`` instead of starting
afresh. :class:`FactorMemory` keeps them per key, and which one each key refines next for a
compressor that refines one a step. Nothing here communicates or computes.
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
    """The last ``P`` and ``Q`` of each key (plain dicts, PyTorch's ``p_memory_dict`` and
    ``q_memory_dict``), and the factor each key's next step refines. A factor that no longer
    fits its gradient (a checkpoint of another model) is dropped with a warning.

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
        """The stored factor ``which`` of ``key`` moved to ``like``'s dtype and device; ``None``
        if there is none, or (dropped, with a warning) if it is not of ``shape``."""
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
        """The factor a one-a-step compressor refines for ``key`` now: not last time's, and
        ``P`` while there is no ``P`` to start ``Q`` from."""
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
        """``p``, ``q`` and ``last_step`` by key as a string; factors are contiguous copies, so
        that a view into a larger buffer saves only its own elements."""
        return {
            "p": {str(k): _copy(t) for k, t in self.p.items()},
            "q": {str(k): _copy(t) for k, t in self.q.items()},
            "last_step": {str(k): v for k, v in self.last_step.items()},
        }

    def load_state_dict(
        self, state_dict: Mapping[str, object], key_of: Callable[[str], Key], prefix: str = ""
    ) -> None:
        """Replace everything by :meth:`state_dict`'s output, checked first (all or nothing):
        ``key_of`` turns a saved key back into a key, ``prefix`` goes before names in messages.

        Raises:
            StateDictError: an entry that is not what :meth:`state_dict` writes.
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
