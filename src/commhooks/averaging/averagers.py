"""Model averagers: average parameters (not gradients) across ranks every few steps.

Called after each ``optimizer.step()`` (``averager.average_parameters(model.parameters())``, as
PyTorch's) or attached to the optimizer once (:meth:`ModelAverager.attach`), with
:func:`commhooks.post_localSGD_hook` or alone. Each counts its steps in ``step``, saved with its
schedule, so a resumed run averages at the same steps.
"""

import collections
import logging
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from commhooks import comm, handshake
from commhooks._warnings import CommHooksWarning
from commhooks.averaging.options import (
    AveragerOptions,
    HierarchicalAveragerOptions,
    OptimizerFactory,
    OuterOptimizerOptions,
    PeriodicAveragerOptions,
)
from commhooks.averaging.outer import (
    check_snapshot,
    load_outer,
    move_to,
    parse_snapshot,
    step_where_finite,
    warn_replaced,
)
from commhooks.averaging.parameters import (
    Named,
    Params,
    average_parameters,
    averaged_views,
    get_params_to_average,
    named_in_groups,
    positional,
)
from commhooks.compress.error_feedback import all_finite
from commhooks.state import (
    HookState,
    StateDictError,
    check_count,
)

__all__ = [
    "HierarchicalModelAverager",
    "ModelAverager",
    "OuterOptimizerAverager",
    "PeriodicModelAverager",
    "average_parameters",
    "get_params_to_average",
    "params_with_grads",
]

logger = logging.getLogger(__name__)
params_with_grads = get_params_to_average  # the name of earlier releases


def _step_count(where: str, value: Any) -> int:
    try:
        return check_count(where, value)
    except StateDictError:
        raise StateDictError(f"{where} must be a non-negative integer, got {value!r}.") from None


# -- The averagers ---------------------------------------------------------------------------------
class ModelAverager(HookState):
    """Base of the averagers: the step counter, warm-up, the once-only check, attaching.
    Subclasses decide at which steps to average (:meth:`_group_due`, the same on every rank)
    and how (:meth:`_average`), over ``process_group`` (``None``: the default group).
    """

    kind: ClassVar[str] = "model_averager"
    options_class: ClassVar[type[AveragerOptions]] = AveragerOptions
    _transient: ClassVar[tuple[str, ...]] = ("_checked", "_attached")

    def __init__(
        self, warmup_steps: int = 0, process_group: dist.ProcessGroup | None = None
    ) -> None:
        self._setup(self.options_class(warmup_steps=warmup_steps), process_group)

    def _setup(self, options: AveragerOptions, process_group: dist.ProcessGroup | None) -> None:
        HookState.__init__(self, process_group)
        self.options = options
        self.step = 0
        self._checked = False
        self._attached: _AfterStep | None = None  # the hook of the last attach()

    @property
    def warmup_steps(self) -> int:
        """Steps that never average (restored from a state dict, as a learning rate is)."""
        return self.options.warmup_steps

    def average_parameters(self, params: Params) -> None:
        """Average ``params`` if this step is due, then advance ``step``.

        ``params``: ``model.parameters()`` or ``optimizer.param_groups``; those without a
        gradient are left out, as PyTorch's averagers do, the others known by their position
        (:meth:`attach` names them, which survives a rebuilt model).
        """
        self.average_named(positional(get_params_to_average(params)))

    def average_named(self, named: Named) -> None:
        """Average the named parameters if this step is due, then advance ``step``: a
        collective there (and at the first call, the schedule's check), on every rank."""
        if not self._checked:
            self.agree_with_ranks()
        due = self._group_due()
        if due is not None:
            self._average(named, due)
        else:
            self._between_syncs(named)
        self.step += 1

    def attach(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    ) -> RemovableHandle:
        """Run this averager after every ``optimizer.step()`` (a step post-hook, whose handle's
        ``remove()`` detaches it) on the parameters that have a gradient, each named by
        ``named_parameters`` (e.g. ``model.named_parameters()``), else by the optimizer's
        names, else by place: state kept per parameter survives a rebuilt model by that name.
        """
        names = None if named_parameters is None else {id(p): n for n, p in named_parameters}
        self._attached = _AfterStep(self, names, weakref.ref(optimizer))
        return optimizer.register_step_post_hook(self._attached)

    def end_step(self) -> None:
        """Count a step the attached optimizer skipped: call it after every
        ``scaler.step(optimizer)``, on every rank.

        A loss scaler skips ``optimizer.step()`` and this averager's post-hook where this
        rank's gradients are not finite. Where the ranks do not average gradients (post-local
        SGD, DiLoCo) a rank skips alone, and uncounted would average at other steps.

        Raises:
            ValueError: the averager is not attached to an optimizer.
        """
        attached = self._attached
        optimizer = None if attached is None else attached.optimizer()
        if attached is None or optimizer is None:
            raise ValueError(
                f"{type(self).__name__}.end_step() counts a step skipped by the optimizer this "
                "averager is attached to, but it is attached to none. Attach it "
                "(averager.attach(optimizer, model.named_parameters())), or call "
                "average_parameters(model.parameters()) after every step, skipped or not."
            )
        if not attached.taken:
            attached(optimizer, (), {})
        attached.taken = False

    @property
    def ranks_agree(self) -> bool:
        """Whether every rank was found to share :meth:`handshake_fields` since the last load."""
        return self._checked

    def agree_with_ranks(self, group: dist.ProcessGroup | None = None) -> None:
        """Check that every rank of ``group`` (``None``: the averager's) shares the schedule:
        one gather, on every rank at the same point, until a state dict is loaded; run by
        whoever communicates first (DiLoCo's DDP hook), before a collective the options shape.

        Raises:
            ValueError: on every rank alike, naming each differing field and its values.
        """
        if self._checked:
            return
        owner = type(self).__name__
        group = comm.resolve_group(self.process_group, owner=owner) if group is None else group
        handshake.check_fields(self.handshake_fields(), group, owner=owner)
        self._checked = True

    def handshake_fields(self) -> dict[str, Any]:
        """The schedule and step, which every rank must share (checked at the first call)."""
        return {**self.options.as_dict(), "step": self.step}

    def _group_due(self) -> dist.ProcessGroup | None:
        raise NotImplementedError

    def _average(self, named: Named, group: dist.ProcessGroup) -> None:
        average_parameters([p for _, p in named], group)

    def _between_syncs(self, named: Named) -> None:
        """Prepare the next sync at a step that does not average (alike on every rank)."""

    def _restore_transient(self) -> None:
        self._checked = False
        self._attached = None  # optimizers do not pickle their hooks: attach again

    # -- state dicts: parse (validate everything) then apply, so a bad dict changes nothing ---
    # The warm-up is restored from the state dict, as an optimizer restores its learning rate;
    # the schedule (:meth:`_schedule`) decides which groups average at all, so another is refused.
    _shown_as: ClassVar[dict[str, tuple[str, Callable[[Any], str]]]] = {}

    def _schedule(self) -> dict[str, Any]:
        """The options saved with the step, as saved: a counter resumed under another schedule
        would silently average at other steps than the saved run."""
        return {}

    def _save(self) -> dict[str, Any]:
        return {"step": self.step, "warmup_steps": self.warmup_steps, **self._schedule()}

    def _load(self, state_dict: Mapping[str, Any]) -> None:
        self._apply(self._parse(state_dict))

    def _parse(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        where = f"{type(self).__name__}.load_state_dict:"
        step = _step_count(f"{where} 'step'", state_dict.get("step"))
        saved_warmup = state_dict.get("warmup_steps", self.warmup_steps)
        warmup = _step_count(f"{where} 'warmup_steps'", saved_warmup)
        for key, current in self._schedule().items():
            if key not in state_dict or state_dict[key] == current:  # absent: saved before it was
                continue
            name, show = self._shown_as.get(key, (key, repr))
            saved = show(state_dict[key])
            raise StateDictError(
                f"{where} the state dict was saved by an averager with {name}={saved}, but this "
                f"one has {name}={show(current)}, so its step counter would average at other "
                f"steps. Build the averager with {name}={saved} to resume from this state dict."
            )
        return {"step": step, "warmup_steps": warmup}

    def _apply(self, values: dict[str, Any]) -> None:
        warmup = values["warmup_steps"]
        if warmup != self.warmup_steps:
            warnings.warn(
                f"{type(self).__name__}.load_state_dict: restored warmup_steps={warmup} from the "
                f"state dict (this averager was built with warmup_steps={self.warmup_steps}), "
                "so the resumed run averages at the steps the saved one would have.",
                CommHooksWarning,
                stacklevel=4,
            )
            self.options = self.options.replace(warmup_steps=warmup)
        self.step = values["step"]
        self._checked = False


@dataclass(eq=False)
class _AfterStep:
    """The step post-hook :meth:`ModelAverager.attach` registers; ``taken`` says that it ran
    since the last :meth:`ModelAverager.end_step` (the optimizer took its step)."""

    averager: ModelAverager
    names: dict[int, str] | None
    optimizer: "weakref.ref[torch.optim.Optimizer]"  # the averager must not keep it alive
    taken: bool = False

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.taken = True
        self.averager.average_named(named_in_groups(optimizer.param_groups, self.names))


class PeriodicModelAverager(ModelAverager):
    """Average across the group at steps ``warmup_steps, warmup_steps + period, ...``
    (counting from 0), as PyTorch's averager of the same name does.

    Args:
        period: steps between averagings; 1 averages every step.
        warmup_steps: steps before the first averaging.
        process_group: the group to average over; ``None`` for the default group.
    """

    kind: ClassVar[str] = "periodic_model_averager"
    options_class: ClassVar[type[AveragerOptions]] = PeriodicAveragerOptions
    options: PeriodicAveragerOptions

    def __init__(
        self, period: int, warmup_steps: int = 0, process_group: dist.ProcessGroup | None = None
    ) -> None:
        options = PeriodicAveragerOptions(period=period, warmup_steps=warmup_steps)
        self._setup(options, process_group)

    @property
    def period(self) -> int:
        """Steps between averagings."""
        return self.options.period

    def _group_due(self) -> dist.ProcessGroup | None:
        if self.step < self.warmup_steps or (self.step - self.warmup_steps) % self.period:
            return None
        return comm.resolve_group(self.process_group, owner=type(self).__name__)

    def _schedule(self) -> dict[str, Any]:
        return {"period": self.period}


def _pairs_as_dict(pairs: Any) -> str:
    """Saved ``[period, size]`` pairs written as the ``{period: size}`` the constructor takes."""
    try:
        return repr({period: size for period, size in pairs})
    except (TypeError, ValueError):
        return repr(pairs)  # malformed: show it as it is


class HierarchicalModelAverager(ModelAverager):
    """Average within groups of several sizes, each on its own period.

    Past the warm-up, a step averages in the largest group whose period divides it (counting
    from 0, as PyTorch does); the smaller groups nest in it. Groups of size ``s`` are
    consecutive blocks of ``s`` ranks of ``process_group``, and inherit its timeout.

    The groups are created at construction (after unpickling, at the first average or read of
    :attr:`period_process_group_dict`): a collective, at the same point on every rank.

    Args:
        period_group_size_dict: ordered ``{period: group size}``, periods increasing, each size
            dividing the world size, the last the whole group: ``{2: 2, 4: 8}`` on 8 ranks
            averages pairs every 2 steps, everyone every 4.
        warmup_steps: as :class:`PeriodicModelAverager`'s.
        process_group: as :class:`PeriodicModelAverager`'s.
    """

    kind: ClassVar[str] = "hierarchical_model_averager"
    options_class: ClassVar[type[AveragerOptions]] = HierarchicalAveragerOptions
    options: HierarchicalAveragerOptions
    _transient: ClassVar[tuple[str, ...]] = ("_checked", "_attached", "_groups")

    def __init__(
        self,
        period_group_size_dict: Mapping[int, int],
        warmup_steps: int = 0,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        # The hierarchy first: a missing group would hide its mistakes.
        given = period_group_size_dict
        options = HierarchicalAveragerOptions(
            period_group_size_dict=tuple(given.items()) if isinstance(given, Mapping) else given,
            warmup_steps=warmup_steps,
        )
        self._setup(options, process_group)
        self._groups: list[dist.ProcessGroup | None] | None = self._create_groups()
        for period, size in self.levels:
            logger.info("hierarchical averaging: groups of %d ranks every %d steps", size, period)

    @property
    def levels(self) -> tuple[tuple[int, int], ...]:
        """The hierarchy as ``(period, group size)`` pairs, periods increasing."""
        return self.options.period_group_size_dict

    @property
    def period_group_size_dict(self) -> dict[int, int]:
        """The hierarchy as given: ``{period: group size}``."""
        return dict(self.levels)

    @property
    def period_process_group_dict(self) -> "collections.OrderedDict[int, Any]":
        """``{period: process group}``, as PyTorch's attribute: this rank's group per level
        (a level of one rank: a group of it alone, as in PyTorch). Read after unpickling, before
        the first average, it creates the groups: a collective."""
        groups = self._groups_now()
        return collections.OrderedDict(
            (period, group) for (period, _), group in zip(self.levels, groups)
        )

    def _groups_now(self) -> list[dist.ProcessGroup | None]:
        if self._groups is None:
            self._groups = self._create_groups()
        return self._groups

    def _create_groups(self) -> list[dist.ProcessGroup | None]:
        parent = comm.resolve_group(self.process_group, owner=type(self).__name__)
        ranks = comm.global_ranks(parent)
        _check_fits_world(self.levels, len(ranks))
        groups: list[dist.ProcessGroup | None] = []
        for _, size in self.levels:  # blocks of one rank too: each rank gets its own group
            if size == len(ranks):
                groups.append(parent)
            else:
                blocks = [ranks[i : i + size] for i in range(0, len(ranks), size)]
                mine = comm.new_groups(blocks, parent)
                groups.append(next(g for g in mine if g is not None))
        return groups

    def handshake_fields(self) -> dict[str, Any]:
        """The hierarchy, warm-up and step, which every rank must share."""
        return {**super().handshake_fields(), "period_group_size_dict": self.period_group_size_dict}

    def _group_due(self) -> dist.ProcessGroup | None:
        if self.step < self.warmup_steps:
            return None
        for (period, _), group in zip(reversed(self.levels), reversed(self._groups_now())):
            if self.step % period == 0:
                return group  # a group of one rank: average_parameters returns at once
        return None

    def _restore_transient(self) -> None:
        super()._restore_transient()
        self._groups = None

    # Saved as [period, size] pairs: a dict with integer keys does not survive every
    # checkpointing tool (torch.distributed.checkpoint turns the keys into strings).
    _shown_as = {"period_group_sizes": ("period_group_size_dict", _pairs_as_dict)}

    def _schedule(self) -> dict[str, Any]:
        return {"period_group_sizes": [[period, size] for period, size in self.levels]}

    def bind(self, process_group: dist.ProcessGroup | None) -> "HierarchicalModelAverager":
        """Average within ``process_group`` (of the hierarchy's size) from now on; its
        subgroups are created on next use."""
        super().bind(process_group)
        self._groups = None
        return self


def _check_fits_world(pairs: tuple[tuple[int, int], ...], world: int) -> None:
    """Raise unless the hierarchy's group sizes fit a group of ``world`` ranks."""
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


class OuterOptimizerAverager(PeriodicModelAverager):
    """Periodic averaging that applies an outer optimizer to the averaged change (DiLoCo).

    Keeps the parameters of the last sync (the snapshot), by name (:meth:`attach`) or else by
    position. At each sync the averaged change since then (``last sync - average of current``)
    is a gradient: the parameters go back to the snapshot and the outer optimizer takes one
    step with it. Outer SGD at learning rate 1 without momentum is plain periodic averaging;
    momentum lets the slow, infrequent global updates build speed.

    The first snapshot is the group's average of the parameters at the last warm-up step (one
    more allreduce), the same on every rank even if the warm-up did not keep them in sync, so
    the first sync already steps the outer optimizer. A sync without a snapshot
    (``warmup_steps=0``) is a plain average, which becomes the snapshot. A state dict of
    version 1, whose snapshot is a list, loads by position.

    Args:
        period: as :class:`PeriodicModelAverager`'s.
        process_group: as :class:`PeriodicModelAverager`'s.
        warmup_steps: steps before the first sync; the last of them takes the snapshot.
        outer_lr: the default outer SGD's learning rate.
        outer_momentum: the default outer SGD's momentum (0: none).
        nesterov: whether the default outer SGD uses Nesterov momentum.
        outer_optimizer: a ``factory(list_of_tensors) -> torch.optim.Optimizer`` replacing the
            default SGD, e.g. ``functools.partial(torch.optim.AdamW, lr=1e-3)`` (a partial, not
            a lambda, if you pickle the averager).

    The snapshot and the outer optimizer's state are in :meth:`state_dict`; loaded, the outer
    optimizer keeps the settings this averager was built with (:func:`load_outer`).
    """

    kind: ClassVar[str] = "outer_optimizer_averager"
    # 2: the snapshot is a mapping from parameter names; 1 saved a positional list.
    version: ClassVar[int] = 2
    options_class: ClassVar[type[AveragerOptions]] = OuterOptimizerOptions
    options: OuterOptimizerOptions

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
        options = OuterOptimizerOptions(
            period=period,
            warmup_steps=warmup_steps,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            nesterov=nesterov,
            outer_optimizer=outer_optimizer,
        )
        self._setup(options, process_group)
        self.outer_optimizer_factory = options.factory()
        self.snapshot: dict[str, torch.Tensor] | None = None
        self.outer_optimizer: torch.optim.Optimizer | None = None

    def handshake_fields(self) -> dict[str, Any]:
        """The schedule, the outer optimizer's options and whether a snapshot exists."""
        return {**self.options.described(), "step": self.step, "synced": self.snapshot is not None}

    def _between_syncs(self, named: Named) -> None:
        if self.step != self.warmup_steps - 1 or not named:
            return
        group = comm.resolve_group(self.process_group, owner=type(self).__name__)
        avg = averaged_views([p for _, p in named], group)
        # Copies in each parameter's dtype: the flat buffer has the widest of them.
        self._start_from({n: a.to(p.dtype, copy=True) for (n, p), a in zip(named, avg)})

    def _start_from(self, snapshot: dict[str, torch.Tensor]) -> None:
        self.snapshot = snapshot
        self.outer_optimizer = self.outer_optimizer_factory(list(snapshot.values()))

    def _average(self, named: Named, group: dist.ProcessGroup) -> None:
        if not named:
            return
        tensors = [p for _, p in named]
        if self.snapshot is None or self.outer_optimizer is None:
            average_parameters(tensors, group)
            self._start_from({n: p.detach().clone() for n, p in named})
            return
        snapshot = self._fit_snapshot(named)  # before the collective, so no rank waits alone
        avg = averaged_views(tensors, group)
        finite = all_finite(*avg)  # the same on every rank: a NaN anywhere is everyone's
        with torch.no_grad():  # in place in the flat buffer: it is not needed after this
            grads = [a.neg_().add_(snap) for snap, a in zip(snapshot, avg)]
            step_where_finite(self.outer_optimizer, snapshot, grads, finite)
            for p, snap in zip(tensors, snapshot):
                p.copy_(snap)

    def _fit_snapshot(self, named: Named) -> list[torch.Tensor]:
        """The snapshot's tensors in the order of ``named``, or ``ValueError`` if they differ."""
        assert self.snapshot is not None and self.outer_optimizer is not None
        names = [n for n, _ in named]
        if set(names) != set(self.snapshot) and _is_positional(self.snapshot, len(names)):
            # Saved by position (an earlier release, or average_parameters): same order.
            self.snapshot = dict(zip(names, self.snapshot.values()))
        check_snapshot(type(self).__name__, self.snapshot, dict(named))
        move_to(named[0][1].device, self.snapshot, [self.outer_optimizer])
        return [self.snapshot[n] for n in names]

    def _save(self) -> dict[str, Any]:
        # "synced": there is a snapshot, from the last warm-up step or from a sync.
        synced = self.snapshot is not None and self.outer_optimizer is not None
        return {
            **super()._save(),
            "snapshot": {n: s.detach().clone() for n, s in (self.snapshot or {}).items()},
            "outer_optimizer": self.outer_optimizer.state_dict() if self.outer_optimizer else {},
            "synced": synced,
        }

    def _parse(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        values = super()._parse(state_dict)
        where = f"{type(self).__name__}.load_state_dict:"
        snapshot = parse_snapshot(where, state_dict, "synced")
        if snapshot is None:
            return {**values, "snapshot": None, "outer_optimizer": None}
        if not snapshot:
            raise StateDictError(f"{where} 'snapshot' must hold a tensor per parameter, got none.")
        outer = load_outer(
            f"{where} the outer optimizer state ('outer_optimizer')",
            self.outer_optimizer_factory,
            state_dict.get("outer_optimizer"),
            list(snapshot.values()),
        )
        chosen = {"outer_optimizer": outer.optimizer, "replaced": outer.replaced}
        return {**values, "snapshot": snapshot, **chosen}

    def _apply(self, values: dict[str, Any]) -> None:
        default_sgd = self.options.outer_optimizer is None
        warn_replaced(type(self).__name__, values.get("replaced", ()), default_sgd)
        super()._apply(values)
        self.snapshot = values["snapshot"]
        self.outer_optimizer = values["outer_optimizer"]


def _is_positional(snapshot: Mapping[str, torch.Tensor], size: int) -> bool:
    return len(snapshot) == size and list(snapshot) == [str(i) for i in range(size)]
