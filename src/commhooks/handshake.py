"""The one cross-rank check a hook makes at its first call on a process group.

Ranks that registered different hooks, wrappers or options issue collectives of different
kinds or sizes: gloo aborts ("Received data size doesn't match"), NCCL hangs, and neither names
the hook. So before its first collective on a group every hook gathers one small record from
every rank (its name, its wrapper's, its state's :meth:`handshake_fields` and
``on_nonfinite``), and if any differs every rank raises the same ``ValueError`` naming what
each runs. It is one ``all_gather_object`` whatever the hook, so ranks running different
hooks still meet in it instead of deadlocking.

On DDP's thread, before the hook's first collective: a stateless hook calls :func:`once`
(remembered per group, weakly, and per hook, wrapper and ``on_nonfinite``); a stateful one
:func:`agree` whenever its state has not been checked on that group (the state forgets it
when it is bound anew, or loads a state dict that changes what it agreed on); a wrapper runs
its inner hook inside :func:`wrapping`, which checks for both.
"""

import contextlib
import threading
import weakref
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from commhooks import comm

__all__ = ["agree", "check_fields", "once", "wrapping"]


@dataclass(frozen=True)
class _Wrapping:
    """The wrapper whose inner hook is running, and the group it has just checked (if any)."""

    wrapper: str
    checked: dist.ProcessGroup | None


# What a group was checked for: the hook, its wrapper (if any) and its on_nonfinite.
_Identity = tuple[str, str | None, str]
_inside: ContextVar[_Wrapping | None] = ContextVar("commhooks_wrapping", default=None)
_lock = threading.Lock()
# Stateless hooks have nowhere else to remember that a group was checked. Keyed by the group's
# id, with a weak reference to the group (a plain dictionary answers in a fraction of a
# weak-keyed one's host time, asked once a bucket); the entry goes when the group does. The
# value is each (hook, wrapper, on_nonfinite) checked.
_checked: "dict[int, tuple[weakref.ref[dist.ProcessGroup], set[_Identity]]]" = {}


def once(group: dist.ProcessGroup, hook: str, on_nonfinite: str = "propagate") -> None:
    """For a hook without a state: check, the first time ``hook`` runs on ``group`` with
    ``on_nonfinite``, that every rank runs the same (one blocking gather, none where a wrapper
    just checked). A rank that repairs non-finite buckets sends them again, so the ranks
    must agree on it as on the hook.

    Raises:
        ValueError: on every rank, when any rank of ``group`` runs another hook or wrapper,
            or another ``on_nonfinite``.
    """
    context = _inside.get()
    if context is not None and context.checked is group:
        return
    identity = (hook, context.wrapper if context is not None else None, on_nonfinite)
    if _seen(group, identity):
        return
    _gather_and_compare(group, _record(hook, identity[1], None, on_nonfinite))
    _remember(group, identity)


def agree(group: dist.ProcessGroup, hook: str, state: Any, reloaded: str | None = None) -> None:
    """For a stateful hook whose state has not been checked on ``group``: check that every
    rank runs ``hook`` with a state that agrees on its fields (one blocking gather).

    Args:
        reloaded: how this rank's state changed its fields by loading a state dict mid-run,
            for the message it raises if the other ranks (which did not) never join.

    Raises:
        ValueError: on every rank, naming the hook and wrapper of each rank or, if those
            match, each differing field of the state and its value on every rank.
        RuntimeError: with ``reloaded``, the other ranks did not join within the group's
            timeout.
    """
    context = _inside.get()
    if context is not None and context.checked is group:
        return
    wrapper = context.wrapper if context is not None else None
    try:
        _gather_and_compare(group, _record(hook, wrapper, state))
    except RuntimeError as exc:
        if reloaded is None:
            raise
        raise RuntimeError(
            f"{hook}: this rank's state was reloaded mid-run ({reloaded}), so it checked again "
            "that every rank agrees on the step count and options before its next collective, "
            "and the other ranks did not join that check within the group's timeout: they did "
            "not reload. Load the state on every rank at the same point, or reload only a "
            f"state dict of the step every rank is at (that needs no check). ({exc})"
        ) from exc


@contextlib.contextmanager
def wrapping(wrapper: str, hook: Any, state: Any, group: dist.ProcessGroup) -> Iterator[None]:
    """Run the inner hook of ``wrapper`` in this context: one check covers both, the first
    time they run on ``group`` (a state that forgot its check later checks again itself).

    Raises:
        ValueError: as :func:`agree`, on every rank.
    """
    context = _inside.get()
    name = hook_name(hook)
    checked: dist.ProcessGroup | None = None
    if context is not None and context.checked is group:
        checked = group  # an outer wrapper has checked this call already
    elif not _seen(group, identity := (name, wrapper, _policy(state))):
        _gather_and_compare(group, _record(name, wrapper, state))
        _remember(group, identity)
        checked = group
    token = _inside.set(_Wrapping(wrapper, checked))
    try:
        yield
    finally:
        _inside.reset(token)


def check_fields(fields: Mapping[str, Any], group: dist.ProcessGroup, *, owner: str) -> None:
    """For objects that are not hooks (the averagers): raise on every rank if any of
    ``fields`` differs between the ranks of ``group`` (one blocking gather).

    Raises:
        ValueError: naming each differing field and its value on every rank.
    """
    record = {"hook": owner, "wrapper": None, "state": owner, "fields": dict(fields)}
    _gather_and_compare(group, record)


def hook_name(hook: Any) -> str:
    """The name a hook is reported by: its ``__name__``, or its type's for other callables."""
    return str(getattr(hook, "__name__", type(hook).__name__))


def fields_of(state: Any) -> dict[str, Any]:
    """What ``state`` needs every rank to agree on: its ``handshake_fields()``, if it has one."""
    method = getattr(state, "handshake_fields", None)
    return dict(method()) if callable(method) else {}


def _record(
    hook: str, wrapper: str | None, state: Any, on_nonfinite: str | None = None
) -> dict[str, Any]:
    owner = type(state).__name__ if state is not None else None
    fields = {**fields_of(state), "on_nonfinite": on_nonfinite or _policy(state)}
    return {"hook": hook, "wrapper": wrapper, "state": owner, "fields": fields}


def _policy(state: Any) -> str:
    """``state``'s ``on_nonfinite``; a process group's (or nothing's) is ``"propagate"``."""
    return str(getattr(state, "on_nonfinite", "propagate"))


def _seen(group: dist.ProcessGroup, identity: _Identity) -> bool:
    # No lock (asked once a bucket): each lookup is atomic, and a stale answer checks again.
    entry = _checked.get(id(group))
    return entry is not None and entry[0]() is group and identity in entry[1]


def _remember(group: dist.ProcessGroup, identity: _Identity) -> None:
    key = id(group)

    def forget(gone: "weakref.ref[dist.ProcessGroup]") -> None:
        # Without the lock: the collector may call this while this thread holds it. The id
        # cannot be reused before this returns (the group's memory is freed after).
        entry = _checked.get(key)
        if entry is not None and entry[0] is gone:
            _checked.pop(key, None)

    with _lock:
        entry = _checked.get(key)
        if entry is None or entry[0]() is not group:
            entry = _checked[key] = (weakref.ref(group, forget), set())
        entry[1].add(identity)


def _gather_and_compare(group: dist.ProcessGroup, record: dict[str, Any]) -> None:
    records = comm.all_gather_objects(record, group)
    runs = [_describe(r) for r in records]
    if len(set(runs)) > 1:
        raise ValueError(
            "commhooks: the ranks of this process group registered different communication "
            f"hooks ({_by_rank(runs)}). Their collectives would not match. Register the same "
            "hook and wrapper on every rank (e.g. commhooks.register with the same arguments "
            "everywhere)."
        )
    message = comm.differing(dict(enumerate(r.get("fields", {}) for r in records)))
    if message:
        raise ValueError(
            f"{record['state'] or record['hook']} was configured differently on different ranks "
            f"({message}). Every rank must build its state with the same options and resume "
            "from the same step."
        )


def _describe(record: Mapping[str, Any]) -> str:
    wrapper = record.get("wrapper")
    return f"{record.get('hook')}" + (f" under {wrapper}" if wrapper else ", no wrapper")


def _by_rank(runs: list[str]) -> str:
    """``"rank 0: a; rank 1: b"``, ranks that run the same thing listed together."""
    ranks: dict[str, list[int]] = {}
    for rank, run in enumerate(runs):
        ranks.setdefault(run, []).append(rank)
    return "; ".join(
        ("rank " if len(r) == 1 else "ranks ") + ", ".join(map(str, r)) + f": {run}"
        for run, r in ranks.items()
    )
