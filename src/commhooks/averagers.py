"""Model averagers: average parameters (not gradients) across ranks every few steps.

Used after ``optimizer.step()`` with :func:`commhooks.post_localSGD_hook`, or alone::

    averager = PeriodicModelAverager(period=4, warmup_steps=100)
    for x, y in data:
        ...
        optimizer.step()
        averager.average_parameters(model.parameters())

Each averager counts its calls in ``step``; averaging happens at the calls the schedule picks.
``step`` is part of :meth:`state_dict`, so a resumed run averages at the same steps.

Every averager communicates through :func:`average_parameters`: one flat buffer, one
allreduce, and it skips parameters without gradients (frozen layers, unused branches), which
every rank must agree on.
"""

import functools
import logging
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from commhooks import comm
from commhooks._validate import check_bool, check_int
from commhooks._warnings import CommHooksWarning
from commhooks.state import HookState, StateDictError

__all__ = [
    "HierarchicalModelAverager",
    "ModelAverager",
    "OuterOptimizerAverager",
    "PeriodicModelAverager",
    "average_parameters",
    "params_with_grads",
]

logger = logging.getLogger(__name__)
Params = Iterable[torch.Tensor] | Iterable[Mapping[str, Any]]
OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def params_with_grads(params: Params) -> list[torch.Tensor]:
    """The parameters that have a gradient, from tensors or optimizer ``param_groups``.

    Raises:
        TypeError: an entry is neither a tensor nor a parameter-group dict.
    """
    out: list[torch.Tensor] = []
    for entry in params:
        group = entry["params"] if isinstance(entry, Mapping) else [entry]
        for p in group:
            if not isinstance(p, torch.Tensor):
                raise TypeError(
                    "average_parameters takes model.parameters() or optimizer.param_groups; "
                    f"got an entry of type {type(p).__name__}."
                )
            if p.grad is not None:
                out.append(p)
    return out


def average_parameters(params: Params, process_group: dist.ProcessGroup | None = None) -> None:
    """Average the parameters that have gradients across ``process_group``, in place.

    One allreduce of a flat copy: per-tensor allreduces would pay the latency once per layer.

    Args:
        params: ``model.parameters()`` or ``optimizer.param_groups``.
        process_group: the group to average over; ``None`` for the default group.
    """
    tensors = params_with_grads(params)
    group = comm.resolve_group(process_group, owner="average_parameters")
    if not tensors or comm.world_size(group) == 1:
        return
    flat = _averaged_flat(tensors, group)
    with torch.no_grad():
        for p, avg in zip(tensors, _views(flat, tensors)):
            p.copy_(avg)


def _averaged_flat(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> torch.Tensor:
    flat = torch.cat([p.detach().reshape(-1) for p in tensors])
    return comm.average(flat, group).wait()


def _views(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    out, offset = [], 0
    for t in like:
        out.append(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


class ModelAverager(HookState):
    """Base of the averagers: the step counter, warm-up, and the once-only option check.

    Subclasses decide at which steps to average (:meth:`_group_due`) and how
    (:meth:`_average`). Both are pure functions of ``step``, identical on every rank.

    Args:
        warmup_steps: calls to :meth:`average_parameters` that never average.
        process_group: the group to average over; ``None`` for the default group.
    """

    kind: ClassVar[str] = "model_averager"
    _transient: ClassVar[tuple[str, ...]] = ("_checked",)

    def __init__(self, warmup_steps: int = 0, process_group: dist.ProcessGroup | None = None):
        check_int(type(self).__name__, "warmup_steps", warmup_steps, 0)
        super().__init__(process_group)
        self.warmup_steps = warmup_steps
        self.step = 0
        self._checked = False

    def average_parameters(self, params: Params) -> None:
        """Average ``params`` if this step is due, then advance ``step``.

        Args:
            params: ``model.parameters()`` or ``optimizer.param_groups``.
        """
        if not self._checked:
            group = comm.resolve_group(self.process_group, owner=type(self).__name__)
            comm.check_same_on_all_ranks(self._options(), group, owner=type(self).__name__)
            self._checked = True
        due = self._group_due()
        if due is not None:
            self._average(params, due)
        else:
            self._between_syncs(params)
        self.step += 1

    def _options(self) -> dict[str, Any]:
        return {"warmup_steps": self.warmup_steps, "step": self.step}

    def _group_due(self) -> dist.ProcessGroup | None:
        raise NotImplementedError

    def _average(self, params: Params, group: dist.ProcessGroup) -> None:
        average_parameters(params, group)

    def _between_syncs(self, params: Params) -> None:
        """Called at the steps that do not average, so a subclass can prepare the next sync.

        Runs after the option check and at the same steps on every rank, so it may communicate.
        Default: nothing.
        """

    def _restore_transient(self) -> None:
        self._checked = False

    # -- state dicts: parse (validate everything) then apply, so a bad dict changes nothing ---
    # The schedule is saved with the step so that a counter is never resumed under another
    # schedule, which would silently average at other steps than the saved run. The warm-up
    # is restored from the state dict, as an optimizer restores its learning rate; the period
    # (and a hierarchy) decide which groups average at all, so a different one is refused.
    def _save(self) -> dict[str, Any]:
        return {"step": self.step, "warmup_steps": self.warmup_steps}

    def _load(self, state_dict: Mapping[str, Any]) -> None:
        self._apply(self._parse(state_dict))

    def _parse(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        step = state_dict.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise StateDictError(
                f"{type(self).__name__}.load_state_dict: 'step' must be a non-negative integer, "
                f"got {step!r}."
            )
        warmup = state_dict.get("warmup_steps", self.warmup_steps)
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise StateDictError(
                f"{type(self).__name__}.load_state_dict: 'warmup_steps' must be a non-negative "
                f"integer, got {warmup!r}."
            )
        return {"step": step, "warmup_steps": warmup}

    def _check_saved_option(
        self,
        state_dict: Mapping[str, Any],
        key: str,
        current: Any,
        name: str | None = None,
        show: Callable[[Any], str] = repr,
    ) -> None:
        """Raise unless the saved ``key`` equals ``current``.

        State dicts written before the options were saved lack the key; they load unchecked.

        Args:
            state_dict: the dict being loaded.
            key: its entry for the option.
            current: this averager's value, in the form :meth:`_save` writes it.
            name: the option's constructor name, if it differs from ``key``.
            show: how to write a value in the message, in the form the constructor takes.

        Raises:
            StateDictError: the saved value differs; the message names both.
        """
        if key not in state_dict or state_dict[key] == current:
            return
        name = name or key
        saved = show(state_dict[key])
        raise StateDictError(
            f"{type(self).__name__}.load_state_dict: the state dict was saved by an averager "
            f"with {name}={saved}, but this one has {name}={show(current)}, so its step counter "
            f"would average at other steps. Build the averager with {name}={saved} to resume "
            "from this state dict."
        )

    def _apply(self, values: dict[str, Any]) -> None:
        warmup = values.get("warmup_steps", self.warmup_steps)
        if warmup != self.warmup_steps:
            warnings.warn(
                f"{type(self).__name__}.load_state_dict: restored warmup_steps={warmup} from the "
                f"state dict (this averager was built with warmup_steps={self.warmup_steps}), "
                "so the resumed run averages at the steps the saved one would have.",
                CommHooksWarning,
                stacklevel=3,
            )
        self.step = values["step"]
        self.warmup_steps = warmup
        self._checked = False


class PeriodicModelAverager(ModelAverager):
    """Average across the group every ``period`` steps once ``warmup_steps`` have passed.

    Averages at steps ``warmup_steps, warmup_steps + period, ...`` (counting from 0), as
    PyTorch's averager of the same name does.

    Args:
        period: steps between averagings; 1 averages every step.
        warmup_steps: steps before the first averaging.
        process_group: the group to average over; ``None`` for the default group.
    """

    kind: ClassVar[str] = "periodic_model_averager"

    def __init__(
        self, period: int, warmup_steps: int = 0, process_group: dist.ProcessGroup | None = None
    ) -> None:
        check_int(
            type(self).__name__, "period", period, 1, " Pass period=k to average every k steps."
        )
        super().__init__(warmup_steps, process_group)
        self.period = period

    def _options(self) -> dict[str, Any]:
        return {**super()._options(), "period": self.period}

    def _group_due(self) -> dist.ProcessGroup | None:
        if self.step < self.warmup_steps or (self.step - self.warmup_steps) % self.period:
            return None
        return comm.resolve_group(self.process_group, owner=type(self).__name__)

    def _save(self) -> dict[str, Any]:
        return {**super()._save(), "period": self.period}

    def _parse(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        values = super()._parse(state_dict)
        self._check_saved_option(state_dict, "period", self.period)
        return values


class HierarchicalModelAverager(ModelAverager):
    """Average within groups of several sizes, each on its own period.

    At a step past the warm-up, the averaging runs in the largest group whose period divides
    the step (counting from 0, as PyTorch does); smaller groups are nested in it, so averaging
    them as well would change nothing. Groups of size ``s`` are consecutive blocks of ``s``
    ranks of ``process_group``.

    The groups are created at construction, a collective over the default group: build the
    averager on every rank at the same point. After unpickling they are created again on the
    first call to :meth:`average_parameters`, which every rank also makes at the same step.

    Args:
        period_group_size_dict: ordered ``{period: group size}``, periods increasing; every
            size divides the world size and the last (longest-period) group is the whole
            ``process_group``. ``{2: 2, 4: 8}`` on 8 ranks: pairs every 2 steps, everyone
            every 4.
        warmup_steps: steps before the first averaging.
        process_group: the whole group; ``None`` for the default group.
    """

    kind: ClassVar[str] = "hierarchical_model_averager"
    _transient: ClassVar[tuple[str, ...]] = ("_checked", "_groups")

    def __init__(
        self,
        period_group_size_dict: Mapping[int, int],
        warmup_steps: int = 0,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(warmup_steps, process_group)
        # The shape of the hierarchy first: its errors need no process group, and looking one
        # up first would report a missing group instead of the mistake in the hierarchy.
        levels = _check_levels(period_group_size_dict)
        world = comm.world_size(comm.resolve_group(process_group, owner=type(self).__name__))
        self.levels = _check_fits_world(levels, world)
        self._groups = self._create_groups()
        for period, size in self.levels:
            logger.info("hierarchical averaging: groups of %d ranks every %d steps", size, period)

    @property
    def period_group_size_dict(self) -> dict[int, int]:
        """The hierarchy as given: ``{period: group size}``."""
        return dict(self.levels)

    def _create_groups(self) -> list[dist.ProcessGroup | None]:
        parent = comm.resolve_group(self.process_group, owner=type(self).__name__)
        ranks = comm.global_ranks(parent)
        if len(ranks) != self.levels[-1][1]:
            raise ValueError(
                f"{type(self).__name__}: the hierarchy was built for {self.levels[-1][1]} "
                f"ranks, but its process group has {len(ranks)}. Build a new averager for it."
            )
        groups: list[dist.ProcessGroup | None] = []
        for _, size in self.levels:
            if size == len(ranks):
                groups.append(parent)
            elif size == 1:
                groups.append(None)  # averaging alone changes nothing
            else:
                blocks = [ranks[i : i + size] for i in range(0, len(ranks), size)]
                groups.append(next(g for g in comm.new_groups(blocks) if g is not None))
        return groups

    def _options(self) -> dict[str, Any]:
        return {**super()._options(), "period_group_size_dict": dict(self.levels)}

    def _group_due(self) -> dist.ProcessGroup | None:
        if self.step < self.warmup_steps:
            return None
        if self._groups is None:
            self._groups = self._create_groups()
        for (period, _), group in zip(reversed(self.levels), reversed(self._groups)):
            if self.step % period == 0:
                return group  # None for groups of one rank: nothing to average
        return None

    def _restore_transient(self) -> None:
        super()._restore_transient()
        self._groups = None

    # Saved as [period, size] pairs: a dict with integer keys does not survive every
    # checkpointing tool (torch.distributed.checkpoint turns the keys into strings).
    def _save(self) -> dict[str, Any]:
        return {**super()._save(), "period_group_sizes": self._level_pairs()}

    def _parse(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        values = super()._parse(state_dict)
        self._check_saved_option(
            state_dict,
            "period_group_sizes",
            self._level_pairs(),
            name="period_group_size_dict",
            show=_pairs_as_dict,
        )
        return values

    def _level_pairs(self) -> list[list[int]]:
        return [[period, size] for period, size in self.levels]

    def bind(self, process_group: dist.ProcessGroup | None) -> "HierarchicalModelAverager":
        """Average within ``process_group`` from now on; its subgroups are created on next use.

        The new group must have the size the hierarchy was built for.
        """
        super().bind(process_group)
        self._groups = None
        return self


def _check_levels(levels: Mapping[int, int]) -> list[tuple[int, int]]:
    """The hierarchy's ``(period, size)`` pairs, checked for what needs no process group."""
    owner = "HierarchicalModelAverager"
    if not isinstance(levels, Mapping) or not levels:
        raise ValueError(
            f"{owner}: period_group_size_dict must be a non-empty ordered mapping "
            f"{{period: group size}}, e.g. {{2: 2, 8: 16}} on 16 ranks; got {levels!r}."
        )
    pairs = list(levels.items())
    for period, size in pairs:
        check_int(owner, "every period", period, 1)
        check_int(owner, "every group size", size, 1)
    periods = [p for p, _ in pairs]
    if any(b <= a for a, b in zip(periods, periods[1:])):
        raise ValueError(
            f"{owner}: periods must be strictly increasing in period_group_size_dict, got "
            f"{periods}. List the smallest group with the shortest period first."
        )
    return pairs


def _check_fits_world(pairs: list[tuple[int, int]], world: int) -> list[tuple[int, int]]:
    """``pairs`` if their group sizes fit a group of ``world`` ranks."""
    owner = "HierarchicalModelAverager"
    for _, size in pairs:
        if world % size:
            raise ValueError(
                f"{owner}: group size {size} does not divide the world size {world}; groups are "
                f"consecutive blocks of ranks, so every size must divide {world}."
            )
    if pairs[-1][1] != world:
        raise ValueError(
            f"{owner}: the largest group (the last entry, period {pairs[-1][0]}) must be the "
            f"whole group of {world} ranks, got size {pairs[-1][1]}. Add or change the last "
            f"entry to {{period: {world}}}."
        )
    return pairs


def _pairs_as_dict(pairs: Any) -> str:
    """Saved ``[period, size]`` pairs written as the ``{period: size}`` the constructor takes."""
    try:
        return repr({period: size for period, size in pairs})
    except (TypeError, ValueError):
        return repr(pairs)  # malformed: show it as it is


def default_outer_optimizer(
    lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True
) -> OptimizerFactory:
    """SGD factory for :class:`OuterOptimizerAverager` (DiLoCo's choice by default)."""
    return functools.partial(
        torch.optim.SGD, lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0
    )


class OuterOptimizerAverager(PeriodicModelAverager):
    """Periodic averaging that applies an outer optimizer to the averaged change (DiLoCo).

    Keeps the parameters as they were at the last sync (the snapshot). At each sync, the
    change the ranks made since then, averaged (``last sync - average of current``), is
    treated as a gradient: the parameters go back to their last-sync values and the outer
    optimizer takes one step with that pseudo-gradient. With outer SGD at learning rate 1 and
    no momentum this is plain periodic averaging; momentum lets the slow, infrequent global
    updates build speed.

    The first snapshot is taken at the last warm-up step (``warmup_steps - 1``), as the
    average over the group of the parameters then: DiLoCo steps from where the local phase
    started, and the average is the same on every rank even if the warm-up did not keep the
    parameters in sync (they are left as they are). That costs one more allreduce, at that
    step. So the first sync already applies the outer optimizer. Without a snapshot at a sync
    (``warmup_steps=0``, or a state dict saved without one, e.g. by an older release) that sync
    is a plain average, which becomes the snapshot; the outer optimizer starts at the next.

    Args:
        period: steps between syncs.
        warmup_steps: steps before the first sync; the last of them takes the snapshot.
        process_group: the group to average over; ``None`` for the default group.
        outer_lr: learning rate of the default outer SGD.
        outer_momentum: momentum of the default outer SGD (0 for none).
        nesterov: Nesterov momentum for the default outer SGD (ignored without momentum).
        outer_optimizer: any ``factory(list_of_tensors) -> torch.optim.Optimizer``, replacing
            the default SGD (and its three options), e.g.
            ``functools.partial(torch.optim.AdamW, lr=1e-3)``. Make it picklable (a partial,
            not a lambda) if you pickle the averager.

    The outer optimizer runs on the averager's own copy of the parameters (the snapshot), so
    its state and the snapshot are in :meth:`state_dict`.
    """

    kind: ClassVar[str] = "outer_optimizer_averager"

    def __init__(
        self,
        period: int,
        warmup_steps: int = 0,
        process_group: dist.ProcessGroup | None = None,
        *,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        outer_optimizer: OptimizerFactory | None = None,
    ) -> None:
        super().__init__(period, warmup_steps, process_group)
        name = type(self).__name__
        if outer_optimizer is None:
            if not isinstance(outer_lr, (int, float)) or not outer_lr > 0:
                raise ValueError(f"{name}: outer_lr must be a positive number, got {outer_lr!r}.")
            if not isinstance(outer_momentum, (int, float)) or not 0 <= outer_momentum < 1:
                raise ValueError(
                    f"{name}: outer_momentum must be in [0, 1), got {outer_momentum!r}."
                )
            check_bool(name, "nesterov", nesterov)
            outer_optimizer = default_outer_optimizer(outer_lr, outer_momentum, nesterov)
            # Named as the user passed them, so a cross-rank mismatch names the option.
            self._outer_options: dict[str, Any] = {
                "outer_lr": outer_lr,
                "outer_momentum": outer_momentum,
                "nesterov": nesterov,
            }
        elif not callable(outer_optimizer):
            raise ValueError(
                f"{name}: outer_optimizer must be a callable taking a list of tensors and "
                f"returning an optimizer, got {type(outer_optimizer).__name__}."
            )
        else:
            described = (
                repr(outer_optimizer)
                if isinstance(outer_optimizer, functools.partial)
                else _qualname(outer_optimizer)
            )
            self._outer_options = {"outer_optimizer": described}
        self.outer_optimizer_factory = outer_optimizer
        self.snapshot: list[torch.Tensor] | None = None
        self.outer_optimizer: torch.optim.Optimizer | None = None

    def _options(self) -> dict[str, Any]:
        return {**super()._options(), **self._outer_options, "synced": self.snapshot is not None}

    def _between_syncs(self, params: Params) -> None:
        if self.step != self.warmup_steps - 1:
            return
        tensors = params_with_grads(params)
        if not tensors:
            return
        group = comm.resolve_group(self.process_group, owner=type(self).__name__)
        avg = _views(_averaged_flat(tensors, group), tensors)
        # Copies in each parameter's dtype: the flat buffer has the widest of them.
        self._start_from([a.to(p.dtype, copy=True) for p, a in zip(tensors, avg)])

    def _start_from(self, snapshot: list[torch.Tensor]) -> None:
        self.snapshot = snapshot
        self.outer_optimizer = self.outer_optimizer_factory(snapshot)

    def _average(self, params: Params, group: dist.ProcessGroup) -> None:
        tensors = params_with_grads(params)
        if not tensors:
            return
        if self.snapshot is None:
            average_parameters(tensors, group)
            self._start_from([p.detach().clone() for p in tensors])
            return
        self._check_fits(tensors)  # before the collective, so no rank is left waiting
        avg = _views(_averaged_flat(tensors, group), tensors)
        with torch.no_grad():
            for snap, a in zip(self.snapshot, avg):
                # In place in the flat buffer: it is not needed after this.
                snap.grad = a.neg_().add_(snap).to(snap.dtype)
        self.outer_optimizer.step()
        self.outer_optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, snap in zip(tensors, self.snapshot):
                p.copy_(snap)

    def _check_fits(self, tensors: list[torch.Tensor]) -> None:
        shapes = [tuple(t.shape) for t in tensors]
        saved = [tuple(s.shape) for s in self.snapshot]
        if shapes != saved:
            raise ValueError(
                f"{type(self).__name__}: the parameters to average ({len(shapes)} tensors) do "
                f"not match the snapshot from the last sync ({len(saved)} tensors); the set of "
                "parameters with gradients changed, or a state dict saved for another model was "
                "loaded. Nothing was changed; load the matching checkpoint."
            )
        if self.snapshot[0].device != tensors[0].device:
            self._move_snapshot(tensors[0].device)

    def _move_snapshot(self, device: torch.device) -> None:
        # Loaded on another device (e.g. a CPU checkpoint): move in place so that the outer
        # optimizer keeps its references, then let it move its own state.
        for snap in self.snapshot:
            snap.data = snap.data.to(device)
        self.outer_optimizer.load_state_dict(self.outer_optimizer.state_dict())

    def _save(self) -> dict[str, Any]:
        # "synced": there is a snapshot, from the last warm-up step or from a sync.
        synced = self.snapshot is not None
        return {
            **super()._save(),
            "snapshot": [s.detach().clone() for s in self.snapshot] if synced else [],
            "outer_optimizer": self.outer_optimizer.state_dict() if synced else {},
            "synced": synced,
        }

    def _parse(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        values = super()._parse(state_dict)
        name = f"{type(self).__name__}.load_state_dict"
        synced, snapshot = state_dict.get("synced"), state_dict.get("snapshot")
        if not isinstance(synced, bool) or not isinstance(snapshot, list):
            raise StateDictError(f"{name}: 'synced' or 'snapshot' is missing or malformed.")
        if not synced:
            return {**values, "snapshot": None, "outer_optimizer": None}
        if not snapshot or not all(isinstance(t, torch.Tensor) for t in snapshot):
            raise StateDictError(f"{name}: 'snapshot' must be a non-empty list of tensors.")
        tensors = [t.detach().clone() for t in snapshot]
        outer = self.outer_optimizer_factory(tensors)
        try:
            outer.load_state_dict(state_dict.get("outer_optimizer"))
        except (KeyError, ValueError, TypeError) as exc:
            raise StateDictError(
                f"{name}: the outer optimizer state does not fit this averager's outer "
                f"optimizer ({type(outer).__name__}): {exc}"
            ) from exc
        return {**values, "snapshot": tensors, "outer_optimizer": outer}

    def _apply(self, values: dict[str, Any]) -> None:
        super()._apply(values)
        self.snapshot = values["snapshot"]
        self.outer_optimizer = values["outer_optimizer"]


def _qualname(obj: Any) -> str:
    return getattr(obj, "__qualname__", type(obj).__qualname__)
