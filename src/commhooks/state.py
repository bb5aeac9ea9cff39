"""The base of every stateful object in the package: hook states, averagers, optimizers.

Two ways to persist one, both safe:

* ``state.state_dict()`` / ``state.load_state_dict(sd)``: only tensors, numbers, strings,
  lists and dicts, so ``torch.load(path, weights_only=True)`` (PyTorch's default since 2.6)
  reads the file back. This is the recommended way, and the one Accelerate and
  ``torch.distributed.checkpoint`` use.
* ``pickle`` / ``torch.save(state)``: as in PyTorch's reference hooks. The process group is not
  picklable and is dropped; an unpickled state is bound to the default group (``None`` where
  ``torch.distributed`` is not initialised yet, which means the same at use) until
  :meth:`HookState.bind` gives it another.
"""

import dataclasses
import numbers
import os
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from commhooks.options import Options, nonfinite_option

__all__ = [
    "HookState",
    "StateDictError",
    "StatelessOptions",
    "StatelessState",
    "check_count",
    "check_optimizer_state",
    "check_tensor",
]


class StateDictError(ValueError):
    """A state dict that cannot be loaded into this object; the object is left unchanged."""


def check_tensor(
    where: str,
    value: Any,
    *,
    dtype: torch.dtype | None = None,
    shape: tuple[int, ...] | None = None,
    floating: bool = False,
    finite: bool = True,
) -> torch.Tensor:
    """Return ``value`` if it is a tensor a state dict may hold, else raise ``StateDictError``.

    A tensor from a file must be dense and contiguous (an expanded, stride-0 tensor, copied or
    saved again, would allocate every element it claims), of the ``dtype`` and ``shape`` given,
    floating point if ``floating``, and finite if ``finite``: a NaN in a memory added to every
    step would poison training for good. ``where`` names the entry in the message.
    """
    if not isinstance(value, torch.Tensor):
        kind = "a floating-point tensor" if floating else "a tensor"
        raise StateDictError(f"{where} must be {kind}, got {type(value).__name__}.")
    _check_storage(where, value)
    _check_kind(where, value, dtype, shape, floating)
    if finite and value.is_floating_point():
        if value.dtype not in _FLOATING:
            raise StateDictError(f"{where} is of dtype {value.dtype}, which cannot be checked.")
        if not bool(torch.isfinite(value).all()):
            raise StateDictError(
                f"{where} holds inf or NaN; loading it would make every later step non-finite. "
                "Load an earlier checkpoint, or start this state afresh."
            )
    return value


def _check_storage(where: str, value: torch.Tensor) -> None:
    if value.layout != torch.strided or not value.is_contiguous():
        raise StateDictError(
            f"{where} must be a dense, contiguous tensor (as state_dict() saves it); got "
            f"layout {value.layout}, shape {tuple(value.shape)}, strides "
            f"{value.stride() if value.layout == torch.strided else '-'}."
        )
    if value.device.type == "meta":
        raise StateDictError(
            f"{where} is on the 'meta' device, which holds no values (a state dict made under "
            "torch.device('meta') or with empty weights); load the file that was saved."
        )


def _check_kind(
    where: str,
    value: torch.Tensor,
    dtype: torch.dtype | None,
    shape: tuple[int, ...] | None,
    floating: bool,
) -> None:
    if floating and value.dtype not in _FLOATING:
        raise StateDictError(
            f"{where} must be a floating-point tensor (float16, bfloat16, float32 or float64), "
            f"got {value.dtype}."
        )
    if dtype is not None and value.dtype != dtype:
        raise StateDictError(f"{where} must be of dtype {dtype}, got {value.dtype}.")
    if shape is not None and tuple(value.shape) != tuple(shape):
        raise StateDictError(f"{where} must have shape {tuple(shape)}, got {tuple(value.shape)}.")


# What a memory, factor or snapshot may be kept in; float8's are refused, as they cannot even
# be checked for inf (and would hold a residual to no useful precision).
_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_count(where: str, value: Any, minimum: int = 0) -> int:
    """Return ``value`` as an ``int >= minimum``; a float, bool, inf or NaN is refused."""
    if (
        isinstance(value, torch.Tensor)
        and value.numel() == 1
        and not value.is_floating_point()
        and value.device.type != "meta"
    ):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        shown = value if isinstance(value, (int, float, str)) else type(value).__name__
        raise StateDictError(f"{where} must be an integer >= {minimum}, got {shown!r}.")
    if int(value) < minimum:
        raise StateDictError(f"{where} must be an integer >= {minimum}, got {int(value)}.")
    return int(value)


def check_optimizer_state(where: str, value: Any, params: Sequence[torch.Tensor]) -> dict[str, Any]:
    """Return ``value`` if it is a ``torch.optim`` state dict whose tensors fit ``params`` (in
    the optimizer's order).

    ``Optimizer.load_state_dict`` takes the per-parameter tensors (momentum, Adam's moments)
    as they come: one with a NaN would poison every later step, one of another shape fails only
    at the next step. Each must be dense, contiguous, finite, and a scalar or of its parameter's
    shape.
    """
    state = value.get("state") if isinstance(value, Mapping) else None
    if not isinstance(state, Mapping) or not isinstance(value.get("param_groups"), list):
        raise StateDictError(
            f"{where} must be an optimizer's state_dict() (with 'state' and 'param_groups'), "
            f"got {type(value).__name__}."
        )
    for key, entry in state.items():
        if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < len(params):
            raise StateDictError(
                f"{where}: 'state' has an entry {key!r}, but there are {len(params)} parameters."
            )
        if not isinstance(entry, Mapping):
            raise StateDictError(f"{where}: 'state'[{key}] must be a dict.")
        for name, t in entry.items():
            if isinstance(t, torch.Tensor):
                t = check_tensor(f"{where} 'state'[{key}][{name!r}]", t)
                if t.dim() and tuple(t.shape) != tuple(params[key].shape):
                    raise StateDictError(
                        f"{where} 'state'[{key}][{name!r}] has shape {tuple(t.shape)}; its "
                        f"parameter has {tuple(params[key].shape)}."
                    )
    return dict(value)


class HookState:
    """Process-group binding, pickling and the ``state_dict`` header shared by all states.

    Subclasses set :attr:`kind`, implement :meth:`_save` and :meth:`_load` (which checks
    everything before assigning anything, so a bad state dict changes nothing), and list in
    :attr:`_transient` what is not pickled (caches rebuilt by :meth:`_restore_transient`).
    """

    kind: ClassVar[str] = "hook_state"
    version: ClassVar[int] = 1
    _transient: ClassVar[tuple[str, ...]] = ()

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self._process_group = process_group

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group this state communicates on; ``None`` means the default group."""
        return self._process_group

    @process_group.setter
    def process_group(self, group: dist.ProcessGroup | None) -> None:
        self.bind(group)

    def bind(self, process_group: dist.ProcessGroup | None) -> "HookState":
        """Communicate on ``process_group`` from now on (for example after unpickling)."""
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                f"{type(self).__name__}.bind expects a ProcessGroup or None, got "
                f"{type(process_group).__name__}."
            )
        self._process_group = process_group
        return self

    @property
    def mesh_place(self) -> dict[str, int | str]:
        """Where this rank sits beyond its place in :attr:`process_group`
        (:mod:`commhooks.place`): empty under DDP, the shard under FSDP2."""
        return dict(self.__dict__.get("_mesh_place", {}))

    @property
    def meets_every_tensor_each_step(self) -> bool:
        """Whether every tensor compressed reaches the hook at each step: under DDP (each
        bucket, unused parameters as zeros), not under FSDP2, where a module left out of a
        step's forward pass calls no hook. Loaded memories that met no tensor in a whole step
        are dropped only where it does (``ErrorFeedback.forget_unmet``)."""
        return not self.__dict__.get("_mesh_place")  # (no copy: read at every bucket)

    def set_mesh_place(self, place: Mapping[str, int | str]) -> None:
        """Record :attr:`mesh_place` (:func:`commhooks.fsdp.register` does); states with
        per-rank memories save it and compare it when one is loaded."""
        self._mesh_place = dict(place)

    @property
    def on_nonfinite(self) -> str:
        """``"propagate"`` or ``"repair"``: the option of the states whose hooks take it."""
        settings = getattr(self, "settings", None)
        return str(getattr(settings, "on_nonfinite", "propagate"))

    def handshake_fields(self) -> dict[str, Any]:
        """What every rank's copy of this state must agree on before its first collective
        (:mod:`commhooks.handshake`): options, and the step counters that decide when the
        hook's collectives change, as plain picklable values."""
        return {}

    # -- pickling ---------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_process_group"] = None
        for name in self._transient:
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        # The default group where one exists, as PyTorch's reference states bind on loading.
        self._process_group = dist.group.WORLD if dist.is_initialized() else None
        self._restore_transient()

    def _restore_transient(self) -> None:
        """Recreate what :attr:`_transient` dropped."""

    # -- state dicts ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly, as plain tensors, numbers, strings and dicts."""
        return {"kind": self.kind, "version": self.version, **self._save()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict`'s output.

        Raises:
            StateDictError: the dict was made by another kind of state, a newer version, or is
                malformed. Nothing is changed in that case.
        """
        self._check_header(state_dict)
        self._load(state_dict)

    def _check_header(self, state_dict: Any) -> None:
        name = type(self).__name__
        if not isinstance(state_dict, Mapping):
            raise StateDictError(
                f"{name}.load_state_dict expects the dict returned by state_dict(), got "
                f"{type(state_dict).__name__}."
            )
        kind = state_dict.get("kind")
        if kind is None:
            raise StateDictError(
                f"{name}.load_state_dict: this is not a commhooks state dict (it has no 'kind' "
                f"entry; keys: {sorted(map(str, state_dict))[:8]}). Save with state.state_dict()."
            )
        if kind != self.kind:
            raise StateDictError(
                f"{name}.load_state_dict: this state dict was saved by a '{kind}' state, not "
                f"'{self.kind}'. Load it into the same kind of hook state it came from."
            )
        version = state_dict.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise StateDictError(
                f"{name}.load_state_dict: the state dict's version must be a positive integer, "
                f"got {version!r}. Pass the unchanged output of state_dict()."
            )
        if version > self.version:
            raise StateDictError(
                f"{name}.load_state_dict: state dict version {version!r} is not supported by "
                f"this release (up to {self.version}). Upgrade commhooks to load it."
            )

    def save(self, path: "str | os.PathLike[str]") -> None:
        """Write :meth:`state_dict` to ``path`` atomically (readable with ``weights_only=True``)."""
        from commhooks.checkpoint import write_atomically

        write_atomically(self.state_dict(), path)

    def load(self, path: "str | os.PathLike[str]") -> None:
        """Load a file written by :meth:`save`, with a clear error if it is not one.

        Raises:
            commhooks.checkpoint.CheckpointError: truncated, corrupt or foreign file.
            StateDictError: a state dict of another kind of state. Nothing changes either way.
        """
        from commhooks.checkpoint import read_weights_only

        self.load_state_dict(read_weights_only(path, what=f"{type(self).__name__} state"))

    def _save(self) -> dict[str, Any]:
        raise NotImplementedError

    def _load(self, state_dict: Mapping[str, Any]) -> None:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True, kw_only=True)
class StatelessOptions(Options):
    """The options of the hooks that keep no state (``allreduce``, ``fp16``, ``bf16``)."""

    owner: ClassVar[str] = "StatelessState"

    on_nonfinite: str = nonfinite_option()


class StatelessState(HookState):
    """The state of a hook that keeps none: its process group and ``on_nonfinite``.

    :func:`commhooks.register` returns one for every hook without a state of its own, so that
    whatever it returned can be checkpointed (an empty entry with a kind and a version). The
    stateless hooks accept it as their state, as they accept the process group itself.
    """

    kind: ClassVar[str] = "stateless"
    version: ClassVar[int] = 1

    def __init__(
        self, process_group: dist.ProcessGroup | None = None, on_nonfinite: str = "propagate"
    ) -> None:
        super().__init__(process_group)
        self.settings = StatelessOptions(on_nonfinite=on_nonfinite)

    def __repr__(self) -> str:
        return f"StatelessState({self.process_group!r}, on_nonfinite={self.on_nonfinite!r})"

    def _save(self) -> dict[str, Any]:
        return {}

    def _load(self, state_dict: Mapping[str, Any]) -> None:
        pass  # the header was checked
