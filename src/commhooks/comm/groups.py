"""Process groups: resolving a hook's group, its size and ranks, the groups the package makes
(per machine, follow-ups), and the rare blocking gathers of small Python objects."""

import datetime
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch.distributed as dist

from commhooks.comm.collectives import completes_inline

__all__ = [
    "all_gather_objects",
    "check_same_on_grid",
    "differing",
    "excludes_this_rank",
    "follow_up_group",
    "gather_objects",
    "global_ranks",
    "group_rank",
    "group_timeout",
    "is_default_group",
    "new_groups",
    "resolve_group",
    "subgroup",
    "world_size",
]


def resolve_group(group: Any, *, owner: str = "this hook") -> dist.ProcessGroup:
    """The process group to communicate on (``None``: the default group), checked; ``owner``
    names the object that complains.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: this rank is not a member of ``group``.
        TypeError: ``group`` is neither a process group nor ``None``.
    """
    if group is None:  # the usual case, asked once a bucket
        world = dist.group.WORLD  # None until torch.distributed is initialised
        if world is not None:
            return world
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{owner} needs torch.distributed: call torch.distributed.init_process_group(...) "
            "before the first backward pass."
        )
    # The exact type first (asked once a bucket): ``isinstance`` on torch's group class takes
    # a Python-level check, about 0.2 us.
    if type(group) is dist.ProcessGroup:
        return group
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"{owner}: this rank (global rank {dist.get_rank()}) is not a member of the process "
            "group it was given. Pass a group that contains every DDP rank, or None for the "
            "default group."
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{owner} expects a torch.distributed.ProcessGroup or None, got {type(group).__name__}."
        )
    return group


def _world() -> dist.ProcessGroup:
    """The default group; only called once torch.distributed is initialised."""
    world = dist.group.WORLD
    if world is None:  # not initialised: resolve_group has said so already
        raise RuntimeError("torch.distributed has no default process group yet.")
    return world


def excludes_this_rank(group: Any) -> bool:
    """Whether ``group`` is what ``new_group`` returns to ranks outside the new group."""
    return group is dist.GroupMember.NON_GROUP_MEMBER


def is_default_group(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` is the default (world) group; ``None`` counts as the default."""
    return group is None or group is dist.group.WORLD


def world_size(group: dist.ProcessGroup | None) -> int:
    """Number of ranks in ``group`` (``None``: the default group)."""
    return dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank inside ``group``."""
    return dist.get_rank(group)


def global_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """The global ranks of ``group``'s members, in group-rank order."""
    return dist.get_process_group_ranks(group if group is not None else _world())


def new_groups(
    rank_lists: list[list[int]], parent: dist.ProcessGroup | None = None
) -> list[dist.ProcessGroup | None]:
    """One process group per list of global ranks (``None`` where this rank is not in it).

    A collective over the default group: every rank calls it with the same lists in the same
    order. The whole world reuses the default group. Each group, and its creation, takes
    ``parent``'s timeout: a dead peer is reported within it, not torch's default 30 minutes.
    """
    world = dist.get_world_size()
    me = dist.get_rank()
    timeout = group_timeout(parent)
    out: list[dist.ProcessGroup | None] = []
    for ranks in rank_lists:
        if sorted(ranks) == list(range(world)):
            out.append(dist.group.WORLD)
            continue
        group = dist.new_group(ranks=sorted(ranks), timeout=timeout)
        out.append(group if me in ranks else None)
    return out


def group_timeout(group: dist.ProcessGroup | None) -> datetime.timedelta:
    """How long a collective on ``group`` (``None``: the default group) may wait for a peer:
    the ``timeout`` it was made with, else the default group's, else torch's default. Every
    group the package makes inherits it, so a dead peer is reported within the time chosen."""
    pg = group if group is not None else dist.group.WORLD
    found = _backend_timeouts(pg)
    if found:
        return max(found)
    if pg is not dist.group.WORLD:
        return group_timeout(None)
    return dist.default_pg_timeout


def _backend_timeouts(pg: Any) -> list[datetime.timedelta]:
    # Private in torch 2.x (``ProcessGroup._get_backend(device).options._timeout``) but the
    # only place the value lives; anything unexpected means "unknown", never an error.
    found: list[datetime.timedelta] = []
    for device in getattr(pg, "_device_types", ()):
        try:
            value = pg._get_backend(device).options._timeout
        except (AttributeError, RuntimeError, TypeError):
            continue
        if isinstance(value, datetime.timedelta) and value.total_seconds() > 0:
            found.append(value)
    return found


def all_gather_objects(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Blocking gather of one picklable object per rank. For rare, small exchanges only."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_objects(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any] | None:
    """Gather one picklable object per rank on the group's first rank (``None`` elsewhere).

    For checkpoints written by one rank: only that rank holds every rank's copy.
    """
    group = group or _world()
    first = dist.get_global_rank(group, 0)
    out: list[Any] | None = (
        [None] * dist.get_world_size(group) if dist.get_rank() == first else None
    )
    dist.gather_object(obj, out, dst=first, group=group)
    return out


def check_same_on_grid(
    options: dict[str, Any], groups: Sequence[dist.ProcessGroup], *, owner: str
) -> None:
    """Raise on every rank of a grid if any option differs between any two of its ranks.

    ``groups`` are this rank's groups along each dimension (for HSDP: its machine's ranks, then
    those holding its shard elsewhere); gathering along one after the other gives every rank
    every rank's options without a group spanning the grid.
    """
    known: dict[int, dict[str, Any]] = {dist.get_rank(): options}
    for group in groups:
        merged: dict[int, dict[str, Any]] = {}
        for part in all_gather_objects(known, group):
            merged.update(part)
        known = merged
    details = differing(dict(sorted(known.items())))
    if details:
        raise ValueError(
            f"{owner} was configured differently on different ranks ({details}). "
            "Every rank must build its state with the same options."
        )


def differing(by_rank: Mapping[int, Mapping[str, Any]]) -> str:
    """``"name: rank 0=a, rank 1=b; ..."`` for each name whose value differs between the ranks
    (keys of ``by_rank``), or ``""``: what an error about ranks configured apart lists."""
    everyone = list(by_rank.values())
    names = sorted(set().union(*(o.keys() for o in everyone)))
    return "; ".join(
        f"{name}: " + ", ".join(f"rank {r}={o.get(name)!r}" for r, o in by_rank.items())
        for name in names
        if any(o.get(name) != everyone[0].get(name) for o in everyone)
    )


def follow_up_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """The group an :class:`OrderedIssuer` issues ``group``'s follow-ups on.

    With NCCL, ``group`` itself: NCCL completes a future as its collective is queued, so every
    follow-up runs on DDP's thread, in order, on every rank. No group made inside a hook
    either: with NCCL initialised eagerly a new group splits the default group's communicator,
    which ranks outside the subgroup, which never run its hook, would have to join.

    Otherwise (gloo, whose callbacks run on its threads) a new group of ``group``'s ranks
    (:func:`subgroup`): call it at the same point on every rank of ``group``.
    """
    if completes_inline() or str(dist.get_backend(group)).lower() == "nccl":
        return group
    return subgroup(dist.get_process_group_ranks(group), group)


def subgroup(ranks: list[int], parent: dist.ProcessGroup) -> dist.ProcessGroup:
    """A new group of ``ranks`` (this rank among them) with ``parent``'s backend and timeout,
    made by its members only: each waits for the others at most that timeout."""
    made = dist.new_group(
        ranks=ranks,
        backend=dist.get_backend(parent),
        timeout=group_timeout(parent),
        use_local_synchronization=True,
    )
    if made is None:  # only for a rank outside the ranks, which calls this never
        raise RuntimeError(f"this rank is not in the group of ranks {ranks} it made.")
    return cast(dist.ProcessGroup, made)
