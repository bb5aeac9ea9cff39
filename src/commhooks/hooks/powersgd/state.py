"""The state of the PowerSGD hooks: its options, and the parts that remember between steps.

Public through :mod:`commhooks.hooks.powersgd`, where the hooks that use it live.
"""

import logging
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from commhooks import comm, handshake, place
from commhooks._warnings import CommHooksWarning, warn_once
from commhooks.compress import lowrank
from commhooks.compress.error_feedback import ErrorFeedback, Key
from commhooks.compress.factors import FactorMemory
from commhooks.hooks.buckets import SavedBuckets
from commhooks.numbering import ParameterNumbering
from commhooks.options import SettingView
from commhooks.state import HookState, StateDictError

from . import codec
from .options import PowerSGDOptions
from .plan import Plan, bucket_order

__all__ = ["PowerSGDState"]

# The hooks' public module: where users look for the statistics it logs.
logger = logging.getLogger("commhooks.hooks.powersgd")


SavedPlace = tuple[int | None, int | None, dict[str, int | str] | None]
"""``(world size, rank, mesh place)`` a loaded state was saved at; ``None`` where not known."""


class PowerSGDState(HookState):
    """Options and memory of :func:`powerSGD_hook` and :func:`batched_powerSGD_hook`.

    The arguments, their defaults and the attributes are PyTorch's, so code ports by changing
    the import; :class:`PowerSGDOptions` (``state.settings``) gives each option's reason.
    ``matrix_approximation_rank`` and ``start_powerSGD_iter`` are the ones to tune. State is
    kept per parameter, so DDP's bucket rebuild cannot misapply it, and ``start_powerSGD_iter``
    may be 0 or 1.

    ``single_round=True`` sends one collective per bucket and step instead of two, refining
    alternately ``P = M Q`` and ``Q = Mᵀ P`` from the other factor of the last step: half the
    latency, but the approximation lags a step, so it converges more slowly at the same rank.

    A step whose result is not finite comes back non-finite, as PyTorch's does (a loss scaler
    skips it), and leaves the memory and factors as they were, decided on the device; with
    ``on_nonfinite="repair"`` such a bucket is averaged again as plain allreduce would.

    Parts, each public: ``settings``, ``memory`` (the error feedback), ``factors`` (warm-start
    ``P`` and ``Q``), ``numbering`` (stable parameter numbers, the memories' keys), ``layouts``
    (the batched hook's bucket contents), ``rng`` (PyTorch's seeds).

    Raises:
        ValueError: an option out of range, with the fix in the message.
    """

    kind = "powersgd"
    version = 1
    _transient = ("_plans", "_layouts", "_checked_group", "_reloaded", "_issuer", "_announced")

    matrix_approximation_rank = SettingView[int]()
    start_powerSGD_iter = SettingView[int]()
    min_compression_rate = SettingView[float]()
    use_error_feedback = SettingView[bool]()
    warm_start = SettingView[bool]()
    orthogonalization_epsilon = SettingView[float]()
    random_seed = SettingView[int]()
    compression_stats_logging_frequency = SettingView[int]()
    batch_tensors_with_same_shape = SettingView[bool]()
    single_round = SettingView[bool]()

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        matrix_approximation_rank: int = 1,
        start_powerSGD_iter: int = 1_000,
        min_compression_rate: float = 2,
        use_error_feedback: bool = True,
        warm_start: bool = True,
        orthogonalization_epsilon: float = 0,
        random_seed: int = 0,
        compression_stats_logging_frequency: int = 10_000,
        batch_tensors_with_same_shape: bool = False,
        single_round: bool = False,
        on_nonfinite: str = "propagate",
    ) -> None:
        super().__init__(process_group)
        given = locals()  # PyTorch's signature; the options themselves are PowerSGDOptions'
        self._settings = PowerSGDOptions(**{n: given[n] for n in PowerSGDOptions.names()})
        # Draws one seed per bucket call wherever PyTorch's hook draws one, in bucket order,
        # which is the same on every rank; numpy's generator so the sequence is PyTorch's.
        self.rng = np.random.RandomState(self.settings.random_seed)
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0
        self.next_stats_report = 0
        self.hook_name: str | None = None  # the hook this state serves, once known
        self.numbering = ParameterNumbering()
        self.memory = ErrorFeedback(codec.OWNER, self.describe, lowrank.plausible_residual)
        self.factors = FactorMemory(codec.OWNER, self.describe)
        self.layouts: dict[str, tuple[int, ...]] = {}
        self.buckets = SavedBuckets()  # DDP's last step's, which a restart's are cut into
        self._saved_world: SavedPlace = (None, None, None)
        self._restore_transient()

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("buckets", SavedBuckets())  # pickled before states kept them
        super().__setstate__(state)

    def _restore_transient(self) -> None:
        self._plans: dict[tuple[int, ...], Plan] = {}
        self._layouts: dict[int, Any] = {}  # by bucket index: what its steps work on
        self._checked_group: dist.ProcessGroup | None = None
        self._reloaded: str | None = None  # how a load mid-run changed the handshake's fields
        self._issuer: tuple[dist.ProcessGroup, comm.OrderedIssuer] | None = None
        self._announced = False
        self.memory.check_before_use()  # unpickled memories are checked as loaded ones are

    @property
    def settings(self) -> PowerSGDOptions:
        """The options, typed and checked; fixed when the state is built."""
        return self._settings

    # -- the reference's public names --------------------------------------------------------
    def options(self) -> dict[str, Any]:
        """Every constructor argument except the process group."""
        return self.settings.as_dict()

    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        """Count one step when the last bucket of the step is handled."""
        if bucket.is_last():
            self.iter += 1

    def compression_stats(self) -> tuple[float, int, int]:
        """``(rate, elements before compression, elements after)`` summed over all steps.

        "After" counts what was sent: both factors a step, or with ``single_round`` the one
        factor the step refines.
        """
        before, after = self.total_numel_before_compression, self.total_numel_after_compression
        return (before / after if after > 0 else 0, before, after)

    @property
    def error_dict(self) -> dict[Key, torch.Tensor]:
        """A new dict of the error-feedback memory's own tensors, by parameter (or bucket)."""
        return dict(self.memory.items())

    @error_dict.setter
    def error_dict(self, value: Mapping[Key, torch.Tensor]) -> None:
        self.memory.clear()
        for key, residual in value.items():
            self.memory.record(key, residual)

    @property
    def p_memory_dict(self) -> dict[Key, torch.Tensor]:
        """The last ``P`` of each matrix (the single-round variant's), by key."""
        return self.factors.p

    @property
    def q_memory_dict(self) -> dict[Key, torch.Tensor]:
        """The last ``Q`` of each matrix (warm start), by key."""
        return self.factors.q

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"PowerSGDState({opts}, iter={self.iter})"

    # -- what the hooks ask ------------------------------------------------------------------
    def prepare(self, hook: str) -> dist.ProcessGroup:
        """The group to communicate on, once this state is fit to serve ``hook``.

        On the first call for a group (and after :meth:`load_state_dict`) the ranks check that
        they agree (:mod:`commhooks.handshake`) and make :attr:`issuer`'s group: collectives,
        so call it on DDP's thread, at the same point on every rank.

        Raises:
            StateDictError: the state belongs to the other PowerSGD hook.
            ValueError: the ranks disagree, or this rank is not in the group.
        """
        self._claim(hook)
        group = comm.resolve_group(self.process_group, owner=hook)
        if self._checked_group is not group:
            handshake.agree(group, hook, self, self._reloaded)
            self._reloaded = None
            self._checked_group = group
        if self._saved_world != (None, None, None):  # the first step after a load
            self._forget_memory_of_another_world(group)
        if self._issuer is None or self._issuer[0] is not group:
            self._issuer = (group, comm.OrderedIssuer(comm.follow_up_group(group)))
        return group

    def handshake_fields(self) -> dict[str, Any]:
        """The options, the hook, and the step count (ranks resumed at different steps would
        start compressing at different steps)."""
        return {**self.options(), "iter": self.iter, "hook": self.hook_name}

    @property
    def issuer(self) -> comm.OrderedIssuer:
        """Issues this state's follow-up collectives in order (made by :meth:`prepare`)."""
        if self._issuer is None:
            raise RuntimeError("PowerSGDState.issuer exists from the first step on (prepare()).")
        return self._issuer[1]

    def compressing(self) -> bool:
        """Whether this step compresses; says so at INFO the first time it does."""
        start = self.settings.start_powerSGD_iter
        if self.iter < start:
            return False
        if not self._announced:
            self._announced = True
            logger.info(
                "PowerSGD: compressing from step %d on (start_powerSGD_iter=%d, "
                "matrix_approximation_rank=%d%s).",
                self.iter,
                start,
                self.settings.matrix_approximation_rank,
                ", single_round" if self.settings.single_round else "",
            )
        return True

    def plan(
        self, numbers: tuple[int, ...], gradients: Callable[[], Sequence[torch.Tensor]]
    ) -> Plan:
        """Which gradients of a bucket of parameters ``numbers`` are compressed (made once)."""
        plan = self._plans.get(numbers)
        if plan is None:
            rank, rate = self.settings.matrix_approximation_rank, self.settings.min_compression_rate
            plan = self._plans[numbers] = Plan.build(numbers, gradients(), rank, rate)
        return plan

    def layout(self, index: int, signature: tuple[object, ...]) -> Any:
        """The layout bucket ``index``'s last step of this ``signature`` (buffer, parameters,
        the factor each matrix refines) worked on, or ``None``."""
        for layout in self._layouts.get(index, ()):
            if layout.signature == signature:
                return layout
        return None

    def keep_layout(self, index: int, layout: Any) -> Any:
        """Keep ``layout`` for bucket ``index``'s later steps (the last two: a single-round
        bucket alternates between two)."""
        kept = self._layouts.setdefault(index, [])
        kept[:] = [layout, *kept[:1]]
        return layout

    def bucket_order(self, key: str, signature: tuple[int, ...]) -> list[int] | None:
        """For the batched hook: :func:`~.plan.bucket_order`; the memory and factors of a bucket
        that now holds other parameters are reset, with a warning."""
        order, changed = bucket_order(self.layouts, key, signature)
        if not changed:
            return order
        had_memory, had_factors = key in self.memory, self.factors.drop(key)
        self.memory.discard(key)
        if had_memory or had_factors:
            warn_once(
                f"powersgd-layout-{key}",
                f"batched_powerSGD_hook: {self.describe(key)} now holds other parameters than "
                "when its error memory and factors were made (DDP may split its buckets "
                "differently after the first step, and a restart with another bucket_cap_mb "
                "does), so that state was reset. Use powerSGD_hook, whose state is per "
                "parameter, to avoid this.",
            )
        return order

    def count_elements(self, before: int, after: int, bucket: dist.GradBucket) -> None:
        """Add a bucket's sizes to :meth:`compression_stats`; log them every so many steps."""
        self.total_numel_before_compression += before
        self.total_numel_after_compression += after
        if bucket.is_last() and self.iter >= self.next_stats_report:
            rate, total_before, total_after = self.compression_stats()
            logger.info(
                "PowerSGD compression stats: step %d, %d elements before compression, %d after, "
                "rate %.2f",
                self.iter,
                total_before,
                total_after,
                rate,
            )
            self.next_stats_report = self.iter + self.settings.compression_stats_logging_frequency

    def number(self, params: list[torch.Tensor]) -> tuple[int, ...]:
        """The parameters' stable numbers (the memories' keys), numbering new ones."""
        return self.numbering.numbers(params)

    def describe(self, key: Key) -> str:
        """Words for the parameter or bucket ``key`` in messages."""
        if isinstance(key, str):
            return f"bucket {key[len('bucket') :]}"
        return self.numbering.describe(key)

    # -- the hook a state serves, and the world it was saved in ------------------------------
    def _claim(self, hook: str) -> None:
        if self.hook_name is None:
            self.hook_name = hook
        elif self.hook_name != hook:
            raise StateDictError(_other_hook(self.hook_name, hook))

    def _forget_memory_of_another_world(self, group: dist.ProcessGroup) -> None:
        size, rank, mesh = self._saved_world
        self._saved_world = (None, None, None)
        if size is None or not len(self.memory):
            return
        mesh = mesh or {}
        if size == group.size() and place.differs(mesh, self.mesh_place):
            why = (
                f"it was saved at {place.describe(mesh)} and is used at "
                f"{place.describe(self.mesh_place)}: under FSDP2 each rank's memory describes "
                "the rows of its own shard, and shard neighbours share their rank in the "
                "replicate group. Load each rank's own file."
            )
            self._forget_memory(f"powersgd-mesh-{sorted(mesh.items())}", why)
            return
        if size != group.size():
            why = (
                f"it was saved with world size {size} and is used with {group.size()}: each "
                "rank's memory is its own share of what compression dropped and does not carry "
                "over to another number of ranks."
            )
            self._forget_memory(f"powersgd-world-{size}-{group.size()}", why)
        elif rank is not None and rank != comm.group_rank(group):
            here = comm.group_rank(group)
            why = (
                f"it was saved by rank {rank} and loaded by rank {here}: a checkpoint written "
                "by one rank for all (Accelerate's save_state does that with a registered "
                "object) holds that rank's memory only. Wrap the state in "
                "commhooks.integrations.checkpoint.PerRankState to save every rank's."
            )
            self._forget_memory(f"powersgd-rank-{rank}-{here}", why)

    def _forget_memory(self, key: str, why: str) -> None:
        count = len(self.memory)
        self.memory.clear()
        warn_once(
            key,
            f"PowerSGDState: the error-feedback memory of {count} tensors was reset, because "
            f"{why} The warm-start factors and the step count were kept.",
        )

    # -- checkpointing -----------------------------------------------------------------------
    def _save(self) -> dict[str, Any]:
        rng = self.rng.get_state()
        assert isinstance(rng, tuple)  # legacy=True, the default: the tuple form
        snapshot = codec.Snapshot(
            counts={name: getattr(self, name) for name in codec.COUNTS},
            rng=rng,
            world_size=_current(comm.world_size, self.process_group),
            rank=_current(comm.group_rank, self.process_group),
            place=self.mesh_place,
            memory=self.memory,
            factors=self.factors,
            layouts=self.layouts,
            hook=self.hook_name,
            buckets=self.buckets.saved(),
        )
        return codec.encode(snapshot, self.settings)

    def _load(self, sd: Mapping[str, Any]) -> None:
        snap = codec.decode(sd, self.settings, self.describe)
        if self.hook_name is not None and snap.hook not in (None, self.hook_name):
            raise StateDictError(_other_hook(snap.hook, self.hook_name))
        agreed = self.handshake_fields()
        for name, count in snap.counts.items():
            setattr(self, name, count)
        self.rng.set_state(snap.rng)
        self.memory, self.factors, self.layouts = snap.memory, snap.factors, snap.layouts
        self.buckets = SavedBuckets(snap.buckets)
        self.hook_name = self.hook_name or snap.hook
        self._saved_world = (snap.world_size, snap.rank, snap.place)
        if self.handshake_fields() != agreed:
            # Another step count: the ranks must agree on it again (a reload of the same step
            # keeps the check, so that one rank may reload alone).
            if self._checked_group is not None:
                self._reloaded = f"from step {agreed['iter']} to step {self.iter}"
            self._checked_group = None
        self._warn_if_memory_lost()

    def _warn_if_memory_lost(self) -> None:
        start = self.settings.start_powerSGD_iter
        if self.settings.use_error_feedback and self.iter > start and not len(self.memory):
            warnings.warn(
                f"PowerSGDState.load_state_dict: the state is at step {self.iter}, past "
                f"start_powerSGD_iter={start}, but holds no error-feedback "
                "memory, so training resumes without it. A checkpoint that keeps one copy of "
                "each key for all ranks (torch.distributed.checkpoint with a plain state_dict) "
                "loses it: save "
                "commhooks.integrations.checkpoint.DistributedCheckpointState(state).",
                CommHooksWarning,
                stacklevel=4,
            )


def _other_hook(saved: str | None, used: str) -> str:
    return (
        f"PowerSGDState: this state belongs to {saved} (it was saved by it, or used with it "
        f"first) and is now used by {used}. powerSGD_hook keeps its memory per parameter and "
        "batched_powerSGD_hook per bucket, so neither carries over to the other: register "
        f"{saved} again, or build a new PowerSGDState for {used}."
    )


def _current(
    read: Callable[[dist.ProcessGroup | None], int], group: dist.ProcessGroup | None
) -> int | None:
    """``read(group)`` where torch.distributed is running, else ``None``."""
    if dist.is_available() and dist.is_initialized():
        return read(group)
    return None


# Pickles and reprs name the public module, whichever module defines the class.
PowerSGDState.__module__ = "commhooks.hooks.powersgd"
