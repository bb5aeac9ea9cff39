"""The one cross-rank check a hook makes at its first call on a process group.

Ranks that registered different hooks, wrappers or state options issue collectives of different
kinds or sizes: gloo then aborts the process ("Received data size doesn't match"), NCCL hangs,
and either way the message names neither hook. So before its first collective on a group,
every commhooks hook gathers one small record from every rank of the group (the hook's name,
its wrapper's, and what its state needs every rank to agree on) and, if any record differs,
every rank raises the same ``ValueError`` naming what each rank runs.

It is exactly one ``all_gather_object`` at the first call, whatever the hook: stateless and
stateful hooks and wrappers all issue the same collective there, so ranks that run different
kinds of hooks still meet in it and report the difference instead of deadlocking.

Who calls what (always on DDP's thread, before the hook's first collective):

* a stateless hook calls :func:`once` with its group and name; the check is remembered per
  group (weakly: a destroyed group is forgotten) and per hook and wrapper;
* a stateful hook calls :func:`agree` with its state whenever the state has not been checked
  on that group yet; the state keeps that memory and forgets it when it loads a state dict or
  is bound to another group. The state's :meth:`handshake_fields` says what must agree;
* a wrapper runs its inner hook inside :func:`wrapping`, which does the check for both; the
  inner hook's own :func:`once` or :func:`agree` then gathers nothing at that call.

The gather goes through :mod:`commhooks.comm`, on the hook's group, so it waits for a missing
peer at most that group's timeout.
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


_inside: ContextVar[_Wrapping | None] = ContextVar("commhooks_wrapping", default=None)
_lock = threading.Lock()
# Stateless hooks have nowhere else to remember that a group was checked. Keyed by the group's
# id, with a weak reference to the group (a plain dictionary answers in a fraction of a
# weak-keyed one's host time, asked once a bucket); the entry goes when the group does. The
# value is each (hook, wrapper) checked.
_checked: "dict[int, tuple[weakref.ref[dist.ProcessGroup], set[tuple[str, str | None]]]]" = {}


def once(group: dist.ProcessGroup, hook: str) -> None:
    """Check, the first time ``hook`` runs on ``group``, that every rank runs the same.

    For hooks without a state. Blocking, one gather, on the first call per group only (and
    none when a wrapper has just checked for this call).

    Raises:
        ValueError: on every rank, when any rank of ``group`` runs another hook or wrapper.
    """
    context = _inside.get()
    if context is not None and context.checked is group:
        return
    identity = (hook, context.wrapper if context is not None else None)
    if _seen(group, identity):
        return
    _gather_and_compare(group, _record(hook, identity[1], None))
    _remember(group, identity)


def agree(group: dist.ProcessGroup, hook: str, state: Any, reloaded: str | None = None) -> None:
    """Check that every rank runs ``hook`` with a state that agrees on its fields.

    For stateful hooks: call it when ``state`` has not been checked on ``group`` yet (it has
    no memory of its own). Blocking, one gather, unless a wrapper has just checked this call.

    Args:
        reloaded: set when the check is made again because this rank's state loaded a state
            dict that changed its fields mid-run; it says how, for the message this rank raises
            if the other ranks never join the check (they did not load one).

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
    """Run the inner hook of ``wrapper`` in this context: one check covers both.

    The first time this wrapper and hook run on ``group``, every rank gathers its record
    (with the state's fields); the inner hook's own check then returns at once. Later calls
    gather nothing here, and the inner hook of a stateful state that forgot its check (after
    loading a state dict) checks again itself, with the wrapper's name.

    Raises:
        ValueError: as :func:`agree`, on every rank.
    """
    context = _inside.get()
    name = hook_name(hook)
    checked: dist.ProcessGroup | None = None
    if context is not None and context.checked is group:
        checked = group  # an outer wrapper has checked this call already
    elif not _seen(group, (name, wrapper)):
        _gather_and_compare(group, _record(name, wrapper, state))
        _remember(group, (name, wrapper))
        checked = group
    token = _inside.set(_Wrapping(wrapper, checked))
    try:
        yield
    finally:
        _inside.reset(token)


def check_fields(fields: Mapping[str, Any], group: dist.ProcessGroup, *, owner: str) -> None:
    """Raise on every rank if any of ``fields`` differs between the ranks of ``group``.

    For objects that are not hooks (the model averagers): one blocking gather, no memory.

    Raises:
        ValueError: naming each differing field and its value on every rank.
    """
    _gather_and_compare(group, {"hook": owner, "wrapper": None, "state": owner, **_as(fields)})


def hook_name(hook: Any) -> str:
    """The name a hook is reported by: its ``__name__``, or its type's for other callables."""
    return str(getattr(hook, "__name__", type(hook).__name__))


def fields_of(state: Any) -> dict[str, Any]:
    """What ``state`` needs every rank to agree on: its ``handshake_fields()``, if it has one."""
    method = getattr(state, "handshake_fields", None)
    return dict(method()) if callable(method) else {}


def _as(fields: Mapping[str, Any]) -> dict[str, Any]:
    return {"fields": dict(fields)}


def _record(hook: str, wrapper: str | None, state: Any) -> dict[str, Any]:
    owner = type(state).__name__ if state is not None else None
    return {"hook": hook, "wrapper": wrapper, "state": owner, **_as(fields_of(state))}


def _seen(group: dist.ProcessGroup, identity: tuple[str, str | None]) -> bool:
    # No lock: one dictionary lookup and one set membership, each atomic, and a stale
    # answer only makes the caller check again (once a bucket, so it must stay cheap).
    entry = _checked.get(id(group))
    return entry is not None and entry[0]() is group and identity in entry[1]


def _remember(group: dist.ProcessGroup, identity: tuple[str, str | None]) -> None:
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
