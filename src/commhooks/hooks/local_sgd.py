"""Post-local SGD: global gradient averaging for a warm-up, then within a machine or none.

A model averager (:mod:`commhooks.averaging.averagers`) then averages the *parameters* every
few steps: slow links are used once a period instead of once a step. Unlike PyTorch's hook,
the per-machine subgroup needs no CUDA (:mod:`commhooks.comm.topology`).

Hook modules must not use ``from __future__ import annotations``: DDP rejects string ones.
"""

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from commhooks import comm, handshake
from commhooks.comm.topology import MACHINE_ID_VAR, local_launch_info, machine_rank_lists
from commhooks.hooks._bucket import GradBucket, gradient_buffer
from commhooks.hooks.buckets import SavedBuckets, parse_buckets
from commhooks.numbering import ParameterNumbering
from commhooks.options import Options, count, flag, option
from commhooks.state import HookState, check_count

__all__ = ["PostLocalSGDOptions", "PostLocalSGDState", "post_localSGD_hook"]

logger = logging.getLogger(__name__)
OWNER = "post_localSGD_hook"
_UNCHANGED: Any = object()


@dataclass(frozen=True, kw_only=True)
class PostLocalSGDOptions(Options):
    """The options of :class:`PostLocalSGDState` (its groups are arguments, not options)."""

    owner: ClassVar[str] = "PostLocalSGDState"

    start_localSGD_iter: int = option(
        reason="optimizer steps with global gradient averaging before the local phase",
        check=count(0),
    )
    post_local_gradient_allreduce: bool = option(
        True,
        "after the warm-up, average gradients within the subgroup (True) or not at all",
        check=flag(),
    )


class PostLocalSGDState(HookState):
    """State of :func:`post_localSGD_hook`.

    Args:
        process_group: the global group; ``None`` for the default group.
        subgroup: the group to average gradients in after the warm-up; ``None`` for one per
            machine, created (a collective) at the first bucket that needs them, or earlier by
            :meth:`ensure_subgroup` on every rank; needed with a custom ``process_group``.
        start_localSGD_iter: as in :class:`PostLocalSGDOptions`.
        post_local_gradient_allreduce: as in :class:`PostLocalSGDOptions`.

    Attributes:
        iter: optimizer steps seen so far, counted at each step's last bucket, also after the
            warm-up (PyTorch's stops at ``start_localSGD_iter``).
        subgroup_source: how the subgroup was obtained (``None`` until it is).
    """

    kind: ClassVar[str] = "post_local_sgd"
    _transient: ClassVar[tuple[str, ...]] = ("_subgroup", "_checked", "_numbering")

    def __init__(
        self,
        process_group: dist.ProcessGroup | None,
        subgroup: dist.ProcessGroup | None,
        start_localSGD_iter: int,
        post_local_gradient_allreduce: bool = True,
    ) -> None:
        self.options = PostLocalSGDOptions(
            start_localSGD_iter=start_localSGD_iter,
            post_local_gradient_allreduce=post_local_gradient_allreduce,
        )
        super().__init__(process_group)
        self.iter = 0
        self.buckets = SavedBuckets()  # DDP's last step's, which a restart's are cut into
        self._checked = False
        self._numbering = ParameterNumbering()
        self._subgroup_explicit = False
        self.bind(process_group, subgroup)
        logger.info("post-local SGD: global gradient averaging for %d steps", start_localSGD_iter)

    @property
    def start_localSGD_iter(self) -> int:
        """Optimizer steps with global gradient averaging (PyTorch's attribute)."""
        return self.options.start_localSGD_iter

    @property
    def post_local_gradient_allreduce(self) -> bool:
        """Whether gradients are averaged within the subgroup after the warm-up."""
        return self.options.post_local_gradient_allreduce

    @property
    def subgroup(self) -> dist.ProcessGroup | None:
        """The group averaging gradients after the warm-up (``None`` until it is created)."""
        return self._subgroup

    def bind(
        self, process_group: dist.ProcessGroup | None, subgroup: Any = _UNCHANGED
    ) -> "PostLocalSGDState":
        """Communicate on ``process_group`` (and ``subgroup``, if given) from now on: after
        unpickling, a state given its subgroup must be bound again with it; per-machine
        subgroups are derived again on first use."""
        given = subgroup is not _UNCHANGED
        if given:
            check_subgroup(subgroup, type(self).__name__)
        explicit = subgroup is not None if given else self._subgroup_explicit
        # Per-machine groups are made by every rank of the default group: ranks outside a
        # custom group would never join, so no guess for them.
        if not explicit and self.post_local_gradient_allreduce and not _every_rank(process_group):
            raise ValueError(
                "PostLocalSGDState: subgroup=None (one subgroup per machine) needs a process "
                "group of every rank. With a process_group of some ranks only, pass subgroup= "
                "explicitly (or post_local_gradient_allreduce=False, which never uses one)."
            )
        super().bind(process_group)
        if given or not explicit:  # per-machine groups are derived within the group: again
            self._subgroup: dist.ProcessGroup | None = subgroup if given else None
            self._subgroup_explicit = explicit
            self.subgroup_source: str | None = "given by the caller" if explicit else None
        return self

    def ensure_subgroup(self) -> dist.ProcessGroup:
        """The post-warm-up group, creating the per-machine groups now if needed (a collective
        over the default group: on every rank at the same point, or left to the hook).

        Raises:
            RuntimeError: the state was unpickled and its explicit subgroup must be re-bound.
        """
        if self._subgroup is not None:
            return self._subgroup
        if self._subgroup_explicit:
            raise RuntimeError(
                f"{type(self).__name__} lost its subgroup when it was unpickled (process groups "
                "cannot be pickled). Re-bind it on every rank: state.bind(process_group, "
                "subgroup=your_subgroup)."
            )
        group = comm.resolve_group(self.process_group, owner=type(self).__name__)
        lists, source = machine_rank_lists(comm.all_gather_objects(local_launch_info(), group))
        mine = [g for g in comm.new_groups(lists, group) if g is not None]
        self._subgroup = mine[0]
        self.subgroup_source = f"one subgroup per machine, from {source}"
        logger.info(
            "post-local SGD: rank %d averages gradients with ranks %s after the warm-up (%s; "
            "set %s to override)",
            comm.group_rank(group),
            comm.global_ranks(self._subgroup),
            self.subgroup_source,
            MACHINE_ID_VAR,
        )
        return self._subgroup

    def handshake_fields(self) -> dict[str, Any]:
        """What every rank's state must agree on at its first step (see commhooks.handshake)."""
        return {
            **self.options.as_dict(),
            "iter": self.iter,
            "subgroup": "explicit" if self._subgroup_explicit else "per machine",
        }

    def begin(self, bucket: GradBucket) -> tuple[dist.ProcessGroup, bool]:
        """The group (checked with the other ranks at the first call, a collective) and whether
        this step is in the warm-up; counts the step at its last bucket."""
        group = comm.resolve_group(self.process_group, owner=OWNER)
        if not self._checked:
            handshake.agree(group, OWNER, self)
            self._checked = True
        warming_up = self.iter < self.start_localSGD_iter
        if bucket.is_last():
            self.iter += 1
            if self.iter == self.start_localSGD_iter:
                logger.info("post-local SGD: local phase starts after %d steps", self.iter)
        return group, warming_up

    def number(self, params: list[torch.Tensor]) -> tuple[int, ...]:
        """The parameters' stable numbers, which :attr:`buckets` keeps DDP's buckets by."""
        return self._numbering.numbers(params)

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("buckets", SavedBuckets())  # pickled before states kept them
        super().__setstate__(state)

    def _restore_transient(self) -> None:
        self._subgroup = None
        self._checked = False
        self._numbering = ParameterNumbering()
        if not self._subgroup_explicit:
            self.subgroup_source = None

    def _save(self) -> dict[str, Any]:
        return {"iter": self.iter, "buckets": [list(b) for b in self.buckets.saved()]}

    def _load(self, state_dict: Mapping[str, Any]) -> None:
        where = f"{type(self).__name__}.load_state_dict:"
        step = check_count(f"{where} 'iter'", state_dict.get("iter"))
        buckets = parse_buckets(where, state_dict.get("buckets", []))  # (absent from older files)
        self.iter, self.buckets = step, SavedBuckets(buckets)
        self._checked = False


def _every_rank(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` holds every rank in order: the default group by another name."""
    default = comm.is_default_group(group)
    return default or comm.global_ranks(group) == list(range(dist.get_world_size()))


def post_localSGD_hook(
    state: PostLocalSGDState, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average globally during the warm-up (bitwise DDP's), then within the subgroup, or not
    at all; with a model averager of the parameters after ``optimizer.step()``
    (:class:`commhooks.PeriodicModelAverager`, or :class:`commhooks.PostLocalSGDOptimizer`).
    """
    if not isinstance(state, PostLocalSGDState):
        raise TypeError(
            f"{OWNER} needs a PostLocalSGDState as its state, got {type(state).__name__}: "
            "ddp.register_comm_hook(PostLocalSGDState(None, None, start_localSGD_iter=...), "
            "post_localSGD_hook)."
        )
    gradient_buffer(bucket, OWNER)
    return state.buckets.average(bucket, state.number, lambda part: _step(state, part))


def _step(state: PostLocalSGDState, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """One bucket's average (DDP's, or one of the saved buckets DDP's are cut into after a
    load: :class:`~commhooks.hooks.buckets.SavedBuckets`), so that a resumed run sums each
    element in the order the uninterrupted run did."""
    buffer = bucket.buffer()
    group, warming_up = state.begin(bucket)
    if warming_up:
        return comm.average(buffer, group)
    if not state.post_local_gradient_allreduce:
        return comm.completed(buffer)
    subgroup = comm.resolve_group(state.ensure_subgroup(), owner=OWNER)
    if comm.world_size(subgroup) == 1:
        return comm.completed(buffer)
    return comm.average(buffer, subgroup)


def check_subgroup(subgroup: Any, owner: str) -> None:
    """``TypeError`` unless ``subgroup`` is a process group or ``None`` (one per machine)."""
    if subgroup is not None and not isinstance(subgroup, dist.ProcessGroup):
        raise TypeError(
            f"{owner}: option 'subgroup' must be a ProcessGroup or None (one group per "
            f"machine), got {type(subgroup).__name__}; a config file leaves it out, and "
            "register(..., subgroup=group) gives one."
        )


def state_from_options(
    process_group: dist.ProcessGroup | None, options: Mapping[str, Any]
) -> PostLocalSGDState:
    """The state of ``commhooks.register(ddp, "post_local_sgd", ...)``: ``options`` are
    :class:`PostLocalSGDOptions`'s, plus ``subgroup``."""
    rest = {k: v for k, v in options.items() if k != "subgroup"}
    checked = PostLocalSGDOptions.from_mapping(rest)
    return PostLocalSGDState(process_group, options.get("subgroup"), **checked.as_dict())
