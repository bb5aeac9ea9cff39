"""The parts of an outer step shared by the outer averager and DiLoCo: a loaded outer optimizer,
checked and run with the settings the averager was built with; a step undone on the device where
its average is not finite; and the global parameters (the snapshot), checked when loaded.
"""

import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from commhooks._warnings import CommHooksWarning
from commhooks.averaging.options import OptimizerFactory
from commhooks.state import StateDictError, check_optimizer_state, check_tensor

__all__ = [
    "PLAUSIBLE_CHANGE",
    "Layout",
    "LoadedOuter",
    "check_plausible",
    "check_snapshot",
    "largest_magnitude",
    "layout_of",
    "load_outer",
    "mismatch",
    "move_to",
    "parse_snapshot",
    "step_where_finite",
    "warn_replaced",
]

PLAUSIBLE_CHANGE = 1e3
"""How far a loaded outer gradient or momentum may reach: ``PLAUSIBLE_CHANGE * (s + 1)``, with
``s`` the largest magnitude among the global parameters it moves. An outer gradient is their
change over one sync's inner steps: a thousand times the parameters themselves (or 1000 for
biases near zero) is no training step but a damaged or foreign file."""

# The default outer SGD's hyper-parameters, by the option that sets each.
_OPTION_OF = {"lr": "outer_lr", "momentum": "outer_momentum", "nesterov": "nesterov"}


@dataclass(frozen=True)
class LoadedOuter:
    """An outer optimizer built fresh, its hyper-parameters its own, loaded with a saved state;
    ``replaced``: ``(name, saved, kept)`` for each saved hyper-parameter that differed."""

    optimizer: torch.optim.Optimizer
    replaced: tuple[tuple[str, Any, Any], ...]


def load_outer(
    where: str,
    factory: OptimizerFactory,
    saved: Any,
    params: list[torch.Tensor],
) -> LoadedOuter:
    """A fresh outer optimizer over ``params`` holding the ``saved`` state, every entry checked.

    The averager's own hyper-parameters win over the saved ones: they are what the user asked
    for now, and what every rank's handshake compared. A saved one that is not a finite number
    (or a flag) is refused as damage; one that differs is replaced and reported in
    :attr:`LoadedOuter.replaced`. A ``momentum_buffer`` must stay within
    :data:`PLAUSIBLE_CHANGE` of ``params``.

    Raises:
        StateDictError: naming the entry; nothing is changed.
    """
    optimizer = factory(params)
    built = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    state = check_optimizer_state(where, saved, params)
    _check_groups(where, state["param_groups"], built)
    scale = largest_magnitude(params)
    for key, entry in state["state"].items():
        buffer = entry.get("momentum_buffer")
        if isinstance(buffer, torch.Tensor):
            named = f"{where} 'state'[{key}]['momentum_buffer']"
            check_tensor(named, buffer, shape=tuple(params[key].shape))
            check_plausible(named, buffer, scale)
    try:
        optimizer.load_state_dict(state)
    except (KeyError, ValueError, TypeError, IndexError) as exc:
        raise StateDictError(f"{where} does not fit {type(optimizer).__name__}: {exc}") from exc
    replaced: dict[str, tuple[str, Any, Any]] = {}
    for group, own in zip(optimizer.param_groups, built):
        for name, value in own.items():
            if _differs(group.get(name), value):
                replaced.setdefault(name, (name, group.get(name), value))
            group[name] = value
    return LoadedOuter(optimizer, tuple(replaced.values()))


def _differs(saved: Any, own: Any) -> bool:
    # A tuple (Adam's betas) may come back from a checkpointing tool as a list.
    if isinstance(saved, (list, tuple)) and isinstance(own, (list, tuple)):
        return tuple(saved) != tuple(own)
    return bool(saved != own)


def _check_groups(where: str, saved: Any, built: list[dict[str, Any]]) -> None:
    """Each saved hyper-parameter that the fresh optimizer has is of its kind, and finite."""
    if not isinstance(saved, list) or len(saved) != len(built):
        raise StateDictError(
            f"{where} 'param_groups' must hold {len(built)} group(s), as the outer optimizer "
            f"has; got {saved!r:.80}."
        )
    for i, (group, own) in enumerate(zip(saved, built)):
        if not isinstance(group, Mapping):
            raise StateDictError(f"{where} 'param_groups'[{i}] must be a dict.")
        for name, value in own.items():
            wanted = _kind_wanted(group[name], value) if name in group else ""
            if wanted:
                raise StateDictError(
                    f"{where} 'param_groups'[{i}][{name!r}] must be {wanted}, as this "
                    f"optimizer's {value!r} is; got {group[name]!r:.80}. Load the unchanged "
                    "output of state_dict()."
                )


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _kind_wanted(saved: Any, own: Any) -> str:
    """What ``saved`` must be to stand where the optimizer holds ``own`` ('' if it may): a flag
    for a flag, a finite number for a number, as many for a tuple of them; anything for what no
    step computes with (None, a string, a device)."""
    if isinstance(own, bool):
        return "" if isinstance(saved, bool) else "True or False"
    if _finite(own):
        return "" if _finite(saved) else "a finite number"
    if isinstance(own, tuple) and all(map(_finite, own)):
        fits = isinstance(saved, (tuple, list)) and len(saved) == len(own)
        return "" if fits and all(map(_finite, saved)) else "a list of finite numbers"
    return ""


def check_plausible(where: str, value: torch.Tensor, scale: float) -> None:
    """Refuse a loaded change (outer gradient, momentum) beyond :data:`PLAUSIBLE_CHANGE`, with
    a ``StateDictError`` naming ``where``, its largest magnitude and the bound."""
    bound = PLAUSIBLE_CHANGE * (scale + 1.0)
    largest = float(value.detach().abs().max()) if value.numel() else 0.0
    if largest > bound:
        raise StateDictError(
            f"{where} reaches {largest:.3g}, beyond any training step of global parameters of "
            f"magnitude up to {scale:.3g} (the bound is {PLAUSIBLE_CHANGE:g} x (that + 1) = "
            f"{bound:.3g}); the file is damaged or was saved for another model. Load an "
            "earlier checkpoint."
        )


def largest_magnitude(tensors: Iterable[torch.Tensor]) -> float:
    """The largest magnitude of any element of ``tensors`` (0 for none): a host read."""
    return max((float(t.detach().abs().max()) for t in tensors if t.numel()), default=0.0)


def warn_replaced(owner: str, replaced: Iterable[tuple[str, Any, Any]], default_sgd: bool) -> None:
    """Say which saved hyper-parameters of an outer optimizer gave way to the built ones."""
    pairs = [
        f"{_OPTION_OF.get(name, name) if default_sgd else name}: saved {saved!r}, kept {kept!r}"
        for name, saved, kept in replaced
    ]
    if not pairs:
        return
    how = "with those options" if default_sgd else "with a factory of those settings"
    warnings.warn(
        f"{owner}.load_state_dict: the outer optimizer was saved with other settings than this "
        f"averager was built with ({'; '.join(pairs)}); the settings it was built with are "
        "kept, as every rank's handshake agreed on them. To resume with the saved ones, build "
        f"the averager {how}.",
        CommHooksWarning,
        stacklevel=5,
    )


def step_where_finite(
    optimizer: torch.optim.Optimizer,
    params: Sequence[torch.Tensor],
    grads: Iterable[torch.Tensor],
    finite: torch.Tensor,
) -> None:
    """``optimizer.step()`` on ``params`` with ``grads``, undone where ``finite`` is false.

    A non-finite average (a worker's NaN) would put NaN in the global parameters and the outer
    momentum for good, on every rank; reading ``finite`` back would make the host wait for the
    device at every sync. So the parameters and their optimizer state are copied before the step
    and taken back after it with ``torch.where``. A state the step made is zeros where it is
    undone, as a fresh one is; one on another device (a step count on the CPU) is left as made.
    """
    before = [p.detach().clone() for p in params]
    held = [_state_on(optimizer, p, finite.device) for p in params]
    kept = [{key: value.clone() for key, value in state.items()} for state in held]
    for p, grad in zip(params, grads):
        p.grad = grad.to(p.dtype)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        for p, was in zip(params, before):
            torch.where(finite, p, was, out=p)
        for p, held_before in zip(params, kept):
            for key, value in _state_on(optimizer, p, finite.device).items():
                prior = held_before.get(key)
                prior = torch.zeros_like(value) if prior is None else prior
                torch.where(finite, value, prior, out=value)


def _state_on(
    optimizer: torch.optim.Optimizer, param: torch.Tensor, device: torch.device
) -> dict[str, torch.Tensor]:
    """The tensors of ``param``'s optimizer state on ``device`` (without making an entry)."""
    state = optimizer.state.get(param, {})
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.device == device}


# -- The global parameters (the snapshot) of the outer averager and of DiLoCo ----------------------
Shape = tuple[int, ...]
Layout = dict[str, tuple[Shape, torch.dtype]]  # a model's parameters: name -> shape, dtype


def layout_of(named: Iterable[tuple[str, torch.Tensor]]) -> Layout:
    """Each parameter's shape and dtype, by name."""
    return {n: (tuple(p.shape), p.dtype) for n, p in named}


def mismatch(saved: torch.Tensor | None, wanted: tuple[Shape, torch.dtype]) -> str:
    """How a global parameter differs from the model's, ``wanted`` ('' if it fits)."""
    shape, dtype = wanted
    if saved is None:
        return "has no global parameter"
    if tuple(saved.shape) == shape and saved.dtype == dtype:
        return ""
    return f"is {tuple(saved.shape)} {saved.dtype}, the model's parameter {shape} {dtype}"


def check_snapshot(
    owner: str,
    snapshot: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    exact: bool = True,
) -> None:
    """Raise ``ValueError``, naming the first that differ, unless ``snapshot`` holds each of
    ``params`` in its shape and dtype (and no other, if ``exact``): before an outer step mixes
    the two."""
    want = layout_of(params.items())
    wrong = [f"{n!r} {w}" for n, shape in want.items() if (w := mismatch(snapshot.get(n), shape))]
    if wrong or (exact and len(params) != len(snapshot)):
        first = f"; first differing: {'; '.join(wrong[:3])}" if wrong else ""
        raise ValueError(
            f"{owner}: the parameters to average ({len(params)} tensors) do not match the "
            f"snapshot from the last sync ({len(snapshot)} tensors{first}; names, shapes and "
            "dtypes must match); the set of parameters with gradients changed, or a state dict "
            "saved for another model was loaded. Nothing was changed; load the matching "
            "checkpoint."
        )


def move_to(
    device: torch.device,
    snapshot: Mapping[str, torch.Tensor],
    optimizers: Iterable[torch.optim.Optimizer],
) -> None:
    """Move the snapshot to ``device`` if it is elsewhere (a CPU checkpoint): in place, so that
    the outer optimizers keep their references; then they move their own state."""
    if next(iter(snapshot.values())).device == device:
        return
    for snap in snapshot.values():
        snap.data = snap.data.to(device)
    for outer in optimizers:
        outer.load_state_dict(outer.state_dict())


def parse_snapshot(
    where: str, state_dict: Mapping[str, Any], flag: str
) -> dict[str, torch.Tensor] | None:
    """The saved snapshot as ``{name: tensor}``, each tensor checked and copied; ``None`` where
    ``state_dict[flag]`` says there is none. A list (version 1) is keyed by position."""
    taken, raw = state_dict.get(flag), state_dict.get("snapshot")
    if not isinstance(taken, bool) or not isinstance(raw, (list, Mapping)):
        raise StateDictError(f"{where} '{flag}' or 'snapshot' is missing or malformed.")
    if not taken:
        return None
    out: dict[str, torch.Tensor] = {}
    for name, t in enumerate(raw) if isinstance(raw, list) else raw.items():
        if not isinstance(name, (str, int)) or isinstance(name, bool):
            raise StateDictError(f"{where} 'snapshot' keys must be parameter names (strings).")
        entry = f"{where} 'snapshot'[{str(name)!r}]"
        out[str(name)] = check_tensor(entry, t, floating=True).detach().clone()
    return out
