"""Every call into ``torch.distributed`` made by the package lives here.

Hooks and averagers describe *what* to communicate; this module decides *how* it is issued.
Keeping the collectives in one place lets us guarantee the property DDP silently relies on:
every rank issues the same collectives in the same order. PyTorch's PowerSGD breaks that on gloo
by starting follow-up collectives from future callbacks, which run on the backend's worker
threads in a different order on each rank. :class:`OrderedIssuer` fixes it by starting
collectives in the order their slots were reserved, whichever thread gets there first.

Everything here is the same on every backend and device. What only makes gloo faster with CPU
tensors (two ranks summing by an exchange, all-to-all and all-gather as point-to-point
messages, the threads that wait for them) lives in :mod:`commhooks.comm.gloo_cpu`, which
:func:`allreduce`, :func:`all_to_all` and :func:`all_gather_into` hand such tensors to.
"""

import atexit
import contextlib
import datetime
import functools
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar, cast

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, AllreduceOptions, AllToAllOptions

from commhooks import _reads
from commhooks.comm import gloo_cpu
from commhooks.comm._futures import fail
from commhooks.comm.polling import PollQueue

__all__ = [
    "CALLBACKS_EXIT_WAIT_S",
    "CALLBACKS_GRACE_S",
    "CollectiveCounter",
    "Finished",
    "Issue",
    "IssuerPool",
    "OrderedIssuer",
    "all_gather_into",
    "all_gather_objects",
    "all_to_all",
    "allreduce",
    "allreduce_rounds",
    "allreduce_then",
    "average",
    "average_polled",
    "backend_for_device",
    "callbacks_held",
    "check_same_on_grid",
    "completed",
    "completing_inline",
    "excludes_this_rank",
    "follow_up_group",
    "follow_up_options",
    "issue_all_gather",
    "issue_all_to_all",
    "issue_allreduce",
    "future_devices",
    "new_future",
    "gather_objects",
    "group_rank",
    "is_default_group",
    "global_ranks",
    "group_timeout",
    "holds_follow_ups",
    "issuer_for",
    "new_groups",
    "observe_collectives",
    "poll",
    "polls",
    "resolve_group",
    "size",
    "then",
    "unheld_follow_ups",
    "when_done",
    "world_size",
]

T = TypeVar("T")
Future = torch.futures.Future


def resolve_group(group: Any, *, owner: str = "this hook") -> dist.ProcessGroup:
    """Return the process group to communicate on, validating it first.

    Args:
        group: a ``ProcessGroup`` or ``None`` for the default (world) group.
        owner: name used in error messages, so the user knows which object complained.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: this rank is not a member of ``group``.
        TypeError: ``group`` is neither a process group nor ``None``.
    """
    if group is None:  # the usual case, asked once a bucket
        # (torch.distributed is available: this module's imports need it)
        world = dist.group.WORLD  # None until torch.distributed is initialised
        if world is not None:
            return world
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{owner} needs torch.distributed: call torch.distributed.init_process_group(...) "
            "before the first backward pass."
        )
    if type(group) is dist.ProcessGroup:  # the usual case, asked once a bucket: see below
        return group
    if group is None:
        return _world()
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"{owner}: this rank (global rank {dist.get_rank()}) is not a member of the process "
            "group it was given. Pass a group that contains every DDP rank, or None for the "
            "default group."
        )
    # ``isinstance`` on torch's group class takes a Python-level check (about 0.2 us), so the
    # exact type is tried first, above.
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


def backend_for_device(group: dist.ProcessGroup | None, device_type: str) -> str:
    """The backend ``group`` uses for tensors on ``device_type`` (``"gloo"``, ``"nccl"``...).

    A group initialised as ``"cpu:gloo,cuda:nccl"`` (PyTorch's default with CUDA) reports
    each device's backend; a plain ``"gloo"`` group serves every device.
    """
    name = str(dist.get_backend(group)).lower()
    if ":" not in name:
        return name
    pairs = dict(part.split(":", 1) for part in name.split(",") if ":" in part)
    return pairs.get(device_type, next(iter(pairs.values())))


def world_size(group: dist.ProcessGroup | None) -> int:
    """Number of ranks in ``group`` (``None``: the default group)."""
    return dist.get_world_size(group)


_sizes: "weakref.WeakKeyDictionary[dist.ProcessGroup, int]" = weakref.WeakKeyDictionary()


def size(group: dist.ProcessGroup) -> int:
    """``group.size()``, remembered: a group's size never changes, and asking the backend for
    it costs the host about a microsecond, which a hook would pay once a bucket."""
    known = _sizes.get(group)
    if known is None:
        known = _sizes[group] = group.size()
    return known


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank inside ``group``."""
    return dist.get_rank(group)


def global_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """The global ranks of ``group``'s members, in group-rank order."""
    return dist.get_process_group_ranks(group if group is not None else _world())


def new_groups(
    rank_lists: list[list[int]], parent: dist.ProcessGroup | None = None
) -> list[dist.ProcessGroup | None]:
    """Create one process group per list of global ranks, in the order given.

    Creating a group is a collective over the default group: every rank must call this with the
    same lists in the same order, including ranks that belong to none of them. A list that is
    the whole world reuses the default group instead of opening new connections. Each group
    takes the timeout of ``parent`` (``None``: the default group), the group it is carved
    from, and so does its creation: a peer that died or stopped during it is reported within
    that timeout, not torch's default of 30 minutes.

    Returns:
        one entry per list: the group where this rank is a member, ``None`` where it is not.
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
    """How long a collective on ``group`` (``None``: the default group) may wait for a peer.

    It is the ``timeout`` given to ``init_process_group`` (or ``new_group``) for that group.
    Torch keeps it in each backend's options; where a backend does not expose it, the default
    group's is taken, and failing that torch's own default. Every group the package creates
    inherits it from the group it derives from, so that a dead or stopped peer is reported
    within the time the user chose.
    """
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


def future_devices(*values: Any) -> list[torch.device]:
    """The CUDA devices of the tensors in ``values``: what a future holding them must know.

    A future created here with those devices records, when its result is set, an event on
    each device's current stream, and whoever waits on it (DDP included) makes its own stream
    wait for that event. A future that does not know them hands over tensors whose kernels may
    still be queued on another stream: on a GPU, the consumer would read them half written.
    """
    if len(values) == 1 and type(values[0]) is torch.Tensor:  # the usual call: one tensor
        return [values[0].device] if values[0].is_cuda else []
    found: dict[str, torch.device] = {}
    for value in values:
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                found[str(t.device)] = t.device
    return list(found.values())


def used_on_current_stream(tensors: Sequence[torch.Tensor]) -> None:
    """Tell the allocator that the CUDA tensors among ``tensors`` are used on the current
    stream: their memory then goes to no other tensor, once they are dropped, before the
    kernels queued on this stream by then have run. For tensors made on one stream (DDP's)
    and last used in a future's callback, which runs on a stream of its own."""
    for t in tensors:
        if t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))


def new_future(devices: Sequence[torch.device] | None = None) -> "Future[Any]":
    """A future to complete by hand, synchronised with the streams of ``devices`` if any."""
    return Future(devices=list(devices)) if devices else Future()


class _Calling(threading.local):
    """What this thread's hooks are called within: ``unheld`` inside
    :func:`unheld_follow_ups`. A class default, so that reading it outside costs no missed
    lookup (a third of a microsecond a bucket on a CPU)."""

    unheld = False


_calling = _Calling()


@contextlib.contextmanager
def unheld_follow_ups() -> Iterator[None]:
    """Within this block, hooks called on this thread never hold their follow-ups.

    For callers that wait for each hook's result before they call the next one (FSDP2's
    all-reduce hook must hand its shard back averaged): a follow-up held until a later bucket
    would then never run.
    """
    with _flag_set(_calling, "unheld"):
        yield


@contextlib.contextmanager
def _flag_set(holder: threading.local, name: str) -> Iterator[None]:
    """Set the thread-local flag ``name`` of ``holder`` within the block (blocks nest)."""
    before = getattr(holder, name, False)
    setattr(holder, name, True)
    try:
        yield
    finally:
        setattr(holder, name, before)


_inline = False  # set by completing_inline(): the test seam for NCCL's futures


@contextlib.contextmanager
def completing_inline() -> Iterator[None]:
    """Within this block, collectives behave as NCCL's do, on any backend: for testing.

    Every future this module returns for a collective is already complete when it is returned
    (NCCL completes a collective's future once the collective is queued, so that a callback
    runs at once, on the thread that issued it), and hooks hold their follow-ups until the
    step's last bucket, as they do on a GPU (:func:`holds_follow_ups`). CPU tests run the
    GPU's control flow this way: the order callbacks run in, how deep they nest, and what is
    held. Process-wide; not for use while another thread issues collectives.
    """
    global _inline
    before, _inline = _inline, True
    try:
        with _reads.as_on_a_gpu():
            yield
    finally:
        _inline = before


def _as_issued(fut: "Future[T]") -> "Future[T]":
    """``fut``, or within :func:`completing_inline` a future holding its result already (one
    complete as it was issued, as NCCL's and :mod:`commhooks.testing.inline_group`'s are, as it is)."""
    if not _inline or fut.done():
        return fut
    try:
        value = fut.wait()
    except BaseException:  # a failed collective: its future already holds the error
        return fut
    return completed(value)


def holds_follow_ups(devices: list[torch.device]) -> bool:
    """Whether a hook holds its follow-ups until the step's last bucket (on a GPU).

    A follow-up reads a check back to the host, which waits until the device has caught up.
    NCCL completes a collective's future as soon as it is queued, so a follow-up runs on DDP's
    thread right away: reading there would stop the backward pass from being queued further, at
    every bucket, and with it the overlap of communication and computation. Held until the last
    bucket (the whole backward pass is queued by then), the first read waits once and the others
    find the device idle. On CPU a read waits for nothing, and follow-ups run when they can.
    Never inside :func:`unheld_follow_ups`; always inside :func:`completing_inline`.
    """
    return (bool(devices) or _inline) and not _calling.unheld


def follow_up_options(buffer: torch.Tensor, last_bucket: bool) -> tuple[list[torch.device], bool]:
    """What a hook passes to :meth:`OrderedIssuer.then` for a follow-up on ``buffer``'s bucket:
    the CUDA devices involved, and whether the follow-up is held (every bucket but the last,
    on a GPU; see :func:`holds_follow_ups`)."""
    devices = future_devices(buffer)
    return devices, holds_follow_ups(devices) and not last_bucket


_polling = threading.local()


def _polled() -> PollQueue:
    """This thread's queue of work to run on it once a collective completes."""
    queue: PollQueue | None = getattr(_polling, "queue", None)
    if queue is None:
        queue = _polling.queue = PollQueue()
    return queue


def polls(tensor: torch.Tensor) -> bool:
    """Whether a hook finishes ``tensor``'s bucket at a :func:`poll` of its own thread rather
    than in a callback of the backend's: for CPU tensors on a backend whose futures complete
    on its own threads (gloo; see :mod:`commhooks.comm.polling`), never on a GPU."""
    return tensor.is_cpu and not _inline


def poll(last_bucket: bool) -> None:
    """Run what this thread's hooks left to run once their collectives completed: whatever
    has completed by now, and at the step's last bucket, or inside
    :func:`unheld_follow_ups` (whose caller waits for each result before it calls the hook
    again), everything, waiting for each collective in turn."""
    _polled().poll(wait=last_bucket or _calling.unheld)


def completed(value: T) -> "Future[T]":
    """A future already holding ``value``: what a hook that sends nothing returns.

    The result is set on the current streams, so consumers wait for the kernels that produced
    ``value`` (see :func:`future_devices`).
    """
    fut: Future[T] = new_future(future_devices(value))
    fut.set_result(value)
    return fut


def _first(fut: "Future[list[torch.Tensor]]") -> torch.Tensor:
    return fut.value()[0]


# -- callbacks on futures --------------------------------------------------------------------
#
# A gloo worker thread that completes a future runs its Python callbacks, then drops them, then
# drops the collective itself (with its tensors); dropping a Python function, or a tensor whose
# Python object outlived Python's own references, needs the GIL. When a training script simply
# ends, the main thread may already be shutting the interpreter down at that moment; Python then
# ends the worker thread where it stands and the C++ runtime aborts the whole process ("terminate
# called without an active exception", exit code -6) after training has finished. It happens on
# the last step, more often on a loaded machine, with PyTorch's own hooks too, and
# ``dist.destroy_process_group()`` does not prevent it while a model or a hook state still holds
# the group.
#
# So every callback the package hands to a future goes through :func:`then` or
# :func:`when_done`, which hand over an object of its own whose release can be observed. At
# exit, before the interpreter starts shutting down, a process that handed out callbacks waits
# without the GIL (so the worker threads can take it) until the callbacks of every completed
# future have been released, at most ``CALLBACKS_EXIT_WAIT_S``, then ``CALLBACKS_GRACE_S`` more
# for the collectives dropped right after them. Callbacks of futures that never completed are
# not waited for: no thread is about to release them. A future complete already (NCCL's, as
# soon as its collective is queued) runs the callback at once on the calling thread, which
# releases it there: nothing is tracked, and the GPU's host pays no more than ``Future.then``.

S = TypeVar("S")

CALLBACKS_EXIT_WAIT_S = 2.0
"""The longest the interpreter's exit waits for worker threads to release callbacks."""

CALLBACKS_GRACE_S = 0.05
"""How long the GIL stays free at exit after the last callback was released."""


def then(fut: "Future[S]", fn: Callable[["Future[S]"], T]) -> "Future[T]":
    """``fut.then(fn)``, with ``fn``'s release awaited at interpreter exit (see above)."""
    if fut.done():  # runs here and now, and is released on this thread
        return fut.then(fn)
    call = functools.partial(fn)  # an object of its own to watch, calling ``fn`` from C
    _registry.track(call, fut)
    return fut.then(call)


def when_done(fut: "Future[S]", fn: Callable[["Future[S]"], None]) -> None:
    """``fut.add_done_callback(fn)``, with ``fn``'s release awaited at interpreter exit."""
    if fut.done():
        fut.add_done_callback(fn)
        return
    call = functools.partial(fn)
    _registry.track(call, fut)
    fut.add_done_callback(call)


def callbacks_held() -> int:
    """Callbacks handed to futures and not released yet (completed futures' and pending)."""
    return len(_registry.entries)


class _Registry:
    """The callbacks handed out and not released yet, each with the future it waits on.

    Keyed by a weak reference to the callback, whose release removes it with the dict's own
    ``pop`` (no Python function runs on the backend's worker thread for it); plain dict
    operations are atomic under the GIL, so no lock is needed (and none could be taken in a
    weakref callback, which may run inside any allocation). The future is held only while its
    callback is: a completed one holds its result's tensors.
    """

    def __init__(self) -> None:
        self.entries: dict[weakref.ref[Callable[..., Any]], Future[Any]] = {}
        self.used = False

    def track(self, call: Callable[..., Any], fut: "Future[Any]") -> None:
        self.used = True
        self.entries[weakref.ref(call, self.entries.pop)] = fut

    def releasing(self) -> bool:
        """Whether a completed future's callback is still held: a thread is about to drop it."""
        return any(fut.done() for fut in list(self.entries.values()))

    def wait(self, limit_s: float = CALLBACKS_EXIT_WAIT_S) -> None:
        if not self.used:
            return
        deadline = time.monotonic() + limit_s
        while self.releasing() and time.monotonic() < deadline:
            time.sleep(0.001)  # sleeping releases the GIL, which the worker thread needs
        time.sleep(CALLBACKS_GRACE_S)

    def forget(self) -> None:
        """In a forked child: the parent's worker threads are not here to release anything."""
        self.entries.clear()
        self.used = False


_registry = _Registry()
atexit.register(_registry.wait)
os.register_at_fork(after_in_child=_registry.forget)


# -- observing what is sent --------------------------------------------------------------------


class CollectiveCounter:
    """Calls and bytes handed to each kind of collective while an observer was open.

    The bytes are what this rank hands over (a collective's input), not what crosses the wire:
    how many bytes that puts on each link depends on the algorithm and the world size, which
    is a cost model's business (``commhooks.bench.costmodel``).
    """

    def __init__(self, torch_calls: bool = False) -> None:
        self.torch_calls = torch_calls  # also counts calls made straight to torch.distributed
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        self._lock = threading.Lock()

    def record(self, kind: str, nbytes: int) -> None:
        """Count one collective of ``kind`` handing over ``nbytes``. Safe from any thread."""
        with self._lock:
            self.calls[kind] = self.calls.get(kind, 0) + 1
            self.bytes[kind] = self.bytes.get(kind, 0) + nbytes


# torch.distributed's collectives that ``observe_collectives(torch_calls=True)`` counts: the
# argument (position, name) holding what this rank hands over; the gathers and scatters take
# their output first.
_TORCH_COLLECTIVES: dict[str, tuple[int, str]] = {
    "all_reduce": (0, "tensor"),
    "broadcast": (0, "tensor"),
    "all_gather": (1, "tensor"),
    "all_gather_into_tensor": (1, "input_tensor"),
    "all_gather_single": (1, "input_tensor"),
    "reduce_scatter_tensor": (1, "input"),
    "all_to_all_single": (1, "input"),
}
_counters: list[CollectiveCounter] = []
_torch_originals: dict[str, Callable[..., Any]] = {}
_torch_watchers = 0
_observers_lock = threading.Lock()
_local = threading.local()  # ``issuing``: this thread is inside one of this module's calls


@contextlib.contextmanager
def observe_collectives(*, torch_calls: bool = False) -> Iterator[CollectiveCounter]:
    """Count the collectives this process issues while inside, per kind: calls and bytes.

    Every collective of the package's hooks is issued here and counted as the collective it
    stands for: the exchange that sums a small tensor on two ranks counts as the allreduce it
    replaces, so that a cost model prices it as the same hook issues it at other world sizes.
    Counting covers every thread (follow-up collectives are issued from the backend's).

    Args:
        torch_calls: also count calls made straight to ``torch.distributed`` (PyTorch's own
            hooks, a user's hook). Its collective functions are wrapped, process-wide, while
            such an observer is open, so that calls through the module attribute are seen;
            calls this module makes are not counted twice. DDP's own allreduce (no hook),
            issued from C++, is never seen.

    Yields:
        the counter, complete once the block is left.
    """
    counter = CollectiveCounter(torch_calls)
    with _observers_lock:
        _counters.append(counter)
        if torch_calls:
            _watch_torch(+1)
    try:
        yield counter
    finally:
        with _observers_lock:
            _counters.remove(counter)
            if torch_calls:
                _watch_torch(-1)


def _watch_torch(change: int) -> None:
    """Wrap torch.distributed's collectives for the first watcher, restore them after the last."""
    global _torch_watchers
    _torch_watchers += change
    if _torch_watchers == 1 and change > 0:
        for name, where in _TORCH_COLLECTIVES.items():
            original = getattr(dist, name, None)
            if original is not None:
                _torch_originals[name] = original
                setattr(dist, name, _counting(name, where, original))
    elif _torch_watchers == 0:
        for name, original in _torch_originals.items():
            setattr(dist, name, original)
        _torch_originals.clear()


def _counting(
    name: str, where: tuple[int, str], original: Callable[..., Any]
) -> Callable[..., Any]:
    position, keyword = where

    def counted(*args: Any, **kwargs: Any) -> Any:
        if not getattr(_local, "issuing", False):
            given = args[position] if len(args) > position else kwargs.get(keyword)
            _observed(name, given, direct=True)
        return original(*args, **kwargs)

    counted.__wrapped__ = original  # type: ignore[attr-defined]
    return counted


@contextlib.contextmanager
def _issuing(kind: str, handed: Any) -> Iterator[None]:
    """Report a collective of ``kind`` handing over ``handed``, then issue it inside the block.

    Calls to torch.distributed inside the block are not reported again: they are (or carry out)
    the collective reported here.
    """
    _observed(kind, handed)
    with _unreported():
        yield


@contextlib.contextmanager
def _unreported() -> Iterator[None]:
    """Calls to torch.distributed inside are part of a collective reported already."""
    with _flag_set(_local, "issuing"):
        yield


def _observed(kind: str, handed: Any, direct: bool = False) -> None:
    """Report a collective of ``kind`` handing over ``handed`` (a tensor or a list of them);
    ``direct``: called straight on torch.distributed, for the observers that asked for those.

    Every function of this module that issues a collective calls it first, with the kind a
    cost model prices (``all_reduce``, ``all_gather_into_tensor``, ``all_to_all_single``...).
    """
    if not _counters:
        return
    tensors = handed if isinstance(handed, (list, tuple)) else [handed]
    nbytes = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    for counter in list(_counters):
        if counter.torch_calls or not direct:
            counter.record(kind, nbytes)


def allreduce(tensor: torch.Tensor, group: dist.ProcessGroup) -> "Future[torch.Tensor]":
    """Sum ``tensor`` in place across ``group``; the future resolves to ``tensor`` itself.

    One collective either way: an allreduce, or on two gloo ranks, for a CPU tensor in half
    precision or of up to 1 MiB in any floating-point dtype, an exchange of the two ranks'
    tensors, added as they arrive (:func:`~commhooks.comm.gloo_cpu.allreduce`), which returns
    sooner. A sparse tensor goes to gloo's sparse allreduce; the future then holds the sum it
    returns.
    """
    return then(issue_allreduce(tensor, group), _first)


def allreduce_then(
    tensor: torch.Tensor, group: dist.ProcessGroup, fn: Callable[[torch.Tensor], T]
) -> "Future[T]":
    """:func:`allreduce`, and ``fn`` on the sum, in the collective's one callback: the future
    holds what ``fn`` returns. A hook's first look at a sum (a division, a check queued behind
    it) then costs no second callback, which a GPU's host pays once a bucket."""
    return then(issue_allreduce(tensor, group), lambda fut: fn(_first(fut)))


def allreduce_rounds(
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    issuer: "OrderedIssuer",
    steps: Sequence["Round"],
    devices: list[torch.device] | None = None,
    hold: bool = False,
    polled: bool = False,
) -> "Future[Any]":
    """:func:`allreduce`, then ``issuer.rounds(sum, steps, devices, hold, polled)``
    (:meth:`OrderedIssuer.rounds`), the first round run on the sum in the collective's own
    callback (or, ``polled``, at a poll) rather than in one of its own."""
    first = steps[0]
    taking = (lambda sums: first(sums[0]), *steps[1:])
    return issuer.rounds(issue_allreduce(tensor, group), taking, devices, hold, polled)


def issue_allreduce(tensor: torch.Tensor, group: dist.ProcessGroup) -> "Future[list[torch.Tensor]]":
    """:func:`allreduce` without its callback: the collective's own future, holding
    ``[tensor]`` summed (or a sparse tensor's sum), for a caller that reads it later (a GPU's
    host pays each callback once a bucket)."""
    if _counters:  # an exchange is counted as the allreduce it stands for
        _observed("all_reduce", tensor)
    if _inline:  # straight to the group, as on NCCL (gloo's CPU exchanges are not NCCL's)
        return _as_issued(_all_reduce(tensor, group).get_future())
    issued = gloo_cpu.allreduce(tensor, group) if tensor.is_cpu else None
    if issued is None:
        issued = _all_reduce(tensor, group).get_future()  # no typing.cast: a call a bucket
    return issued


Options = TypeVar("Options", AllreduceOptions, AllToAllOptions, AllgatherOptions)


def _without_waiting(options: Options) -> Options:
    """``options`` for a collective issued without waiting, as every hook asks: ``asyncOp``
    where this torch has the field (2.7 on, where it is the default too; before it, a group's
    own calls never waited), so that the package imports on every torch it supports."""
    if hasattr(options, "asyncOp"):
        options.asyncOp = True
    return options


_SUM = _without_waiting(AllreduceOptions())  # a sum: what every hook asks for
_SUM.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)


def _all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup) -> Any:
    """``dist.all_reduce(tensor, group=group, async_op=True)``'s work, issued straight on the
    group: the same call into the backend without the checks of a group this module has
    resolved already, half the host time per bucket (11 against 21 us on this machine)."""
    if tensor.is_complex() or tensor.layout != torch.strided:
        with _unreported():  # counted already, as what it is
            return dist.all_reduce(tensor, group=group, async_op=True)
    return group.allreduce([tensor], _SUM)


def _future_of(work: Any) -> "Future[list[torch.Tensor]]":
    """The future of an asynchronous collective's ``Work`` (typed: torch's stubs say ``Any``)."""
    fut: Future[list[torch.Tensor]] = work.get_future()  # no typing.cast: a call a bucket
    return fut


def all_to_all(
    out: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup
) -> "Future[torch.Tensor]":
    """Send row ``i`` of ``tensor`` to rank ``i``; row ``j`` of ``out`` comes from rank ``j``.

    Both are ``world_size x ...`` and contiguous. The future resolves to ``out``. On gloo with
    CPU tensors the rows travel as point-to-point messages, every receive posted before any
    send (see :func:`~commhooks.comm.gloo_cpu.all_to_all`). On a group of one rank nothing
    travels: ``out`` becomes ``tensor`` (nothing to do where they are one), at once.
    """
    if size(group) == 1:
        return _kept_here(out, tensor)
    with _issuing("all_to_all_single", tensor):
        done: Future[Any] | None = gloo_cpu.all_to_all(out, tensor, group)
        if done is None:
            done = _future_of(dist.all_to_all_single(out, tensor, group=group, async_op=True))
    return _as_issued(then(done, lambda fut: _checked(fut, out)))


def all_gather_into(
    out: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup
) -> "Future[torch.Tensor]":
    """Row ``j`` of ``out`` (``world_size x tensor.numel()``) becomes rank ``j``'s ``tensor``.

    The future resolves to ``out``. On gloo with CPU tensors each rank sends its tensor to
    every other rank directly, every receive posted first (see
    :func:`~commhooks.comm.gloo_cpu.all_gather_into`): the same bytes leave each rank as in
    gloo's ring. On a group of one rank nothing travels: ``out`` becomes ``tensor``, at once.
    """
    if size(group) == 1:
        return _kept_here(out, tensor)
    with _issuing("all_gather_into_tensor", tensor):
        done: Future[Any] | None = gloo_cpu.all_gather_into(out, tensor, group)
        if done is None:
            rows, flat = out.view(group.size(), -1), tensor.reshape(1, -1)
            done = _future_of(_all_gather_single()(rows, flat, group=group, async_op=True))
    return _as_issued(then(done, lambda fut: _checked(fut, out)))


_EXCHANGE = _without_waiting(AllToAllOptions())
_GATHER = _without_waiting(AllgatherOptions())


def issue_all_to_all(
    out: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup
) -> "Future[Any]":
    """:func:`all_to_all` for a group of several ranks whose collectives complete as they are
    issued (NCCL's; see :func:`follow_up_group`), straight on the group and without a
    callback: for a caller that only waits on the future (its value is the backend's), which
    saves torch.distributed's checks and a callback on the host, a bucket."""
    if _counters:
        _observed("all_to_all_single", tensor)
    # The group's methods of every torch this package supports (newer ones add other names).
    return _as_issued(group.alltoall_base(out, tensor, [], [], _EXCHANGE).get_future())


def issue_all_gather(
    out: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup
) -> "Future[Any]":
    """:func:`all_gather_into` as :func:`issue_all_to_all` issues :func:`all_to_all`."""
    if _counters:
        _observed("all_gather_into_tensor", tensor)
    # The group's gather into one tensor on every supported torch: what
    # ``dist.all_gather_into_tensor`` calls (newer torch also names it ``all_gather_single``).
    work = group._allgather_base(out.view(-1), tensor.view(-1), _GATHER)
    return _as_issued(work.get_future())


def _kept_here(out: torch.Tensor, tensor: torch.Tensor) -> "Future[torch.Tensor]":
    """A one-rank exchange: ``tensor``'s elements in ``out`` (no copy where they are one)."""
    if out.data_ptr() != tensor.data_ptr():
        out.view(-1).copy_(tensor.reshape(-1))
    return completed(out)


def _checked(fut: "Future[Any]", out: torch.Tensor) -> torch.Tensor:
    fut.value()  # raises here, in the callback, if the collective failed
    return out


def _all_gather_single() -> Callable[..., Any]:
    # Renamed in recent PyTorch, where the old name warns on every call.
    gather: Callable[..., Any] = getattr(dist, "all_gather_single", None) or (
        dist.all_gather_into_tensor
    )
    return gather


def average(tensor: torch.Tensor, group: dist.ProcessGroup) -> "Future[torch.Tensor]":
    """Average ``tensor`` in place across ``group``.

    Scaling happens before the sum, as DDP itself does, so the partial sums stay in range. We
    multiply a dense tensor by ``1 / world_size`` and divide a sparse one (the future then holds
    the summed sparse tensor) because that is DDP's own arithmetic: results are bitwise
    identical to training without a hook, at any world size.
    """
    return allreduce(_scaled_for_average(tensor, size(group)), group)


def average_polled(tensor: torch.Tensor, group: dist.ProcessGroup) -> "Future[torch.Tensor]":
    """:func:`average`, its future completed by this thread's :func:`poll` rather than in a
    callback on the backend's thread (where :func:`polls` says so)."""
    issued = issue_allreduce(_scaled_for_average(tensor, size(group)), group)
    out: Future[list[torch.Tensor]] = Future()
    _polled().add(issued, lambda fut: _forward(fut, out))
    # A future derived with ``then`` fails as a real error when the collective failed; one
    # completed by hand would hold the error as a value, which DDP fails to read as a tensor.
    # Not through :func:`then`: ``out`` is completed on this thread, which releases the callback.
    return out.then(_first)


def _scaled_for_average(tensor: torch.Tensor, world: int) -> torch.Tensor:
    """``tensor``, scaled in place by ``1 / world`` as DDP scales it (see :func:`average`)."""
    if tensor.layout == torch.strided:
        return tensor.mul_(1.0 / world)
    return tensor.div_(world)


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
    """Raise on every rank of a grid of ranks if any option differs between any two of them.

    ``groups`` are this rank's groups along each dimension of the grid (for HSDP: the ranks of
    its machine, then the ranks holding the same shard on other machines). What each rank knows
    is gathered along one dimension after the other, so after the last every rank holds every
    rank's options without a group spanning the grid; one small gather per dimension, once.

    Raises:
        ValueError: naming each differing option and its value on every rank (global ranks).
    """
    known: dict[int, dict[str, Any]] = {dist.get_rank(): options}
    for group in groups:
        merged: dict[int, dict[str, Any]] = {}
        for part in all_gather_objects(known, group):
            merged.update(part)
        known = merged
    _raise_if_differing(dict(sorted(known.items())), owner)


def _raise_if_differing(by_rank: Mapping[int, Mapping[str, Any]], owner: str) -> None:
    everyone = list(by_rank.values())
    differing = [
        name
        for name in sorted(set().union(*(o.keys() for o in everyone)))
        if any(o.get(name) != everyone[0].get(name) for o in everyone)
    ]
    if differing:
        details = "; ".join(
            f"{name}: " + ", ".join(f"rank {r}={o.get(name)!r}" for r, o in by_rank.items())
            for name in differing
        )
        raise ValueError(
            f"{owner} was configured differently on different ranks ({details}). "
            "Every rank must build its state with the same options."
        )


class Finished(Generic[T]):
    """What a round of :meth:`OrderedIssuer.rounds` returns to end its pipeline with ``value``."""

    __slots__ = ("value",)

    def __init__(self, value: T) -> None:
        self.value = value


class Issue:
    """What a round of :meth:`OrderedIssuer.rounds` returns to send something: ``launch``
    issues one collective on the issuer's group, in the round's turn, and returns its future
    (or :class:`Finished`, if it finds nothing to send: a launch may read state that only
    rounds in their turn may touch, one at a time)."""

    __slots__ = ("launch",)

    def __init__(self, launch: Callable[[], "Future[Any] | Finished[Any]"]) -> None:
        self.launch = launch


Round = Callable[[Any], "Finished[Any] | Issue"]


class OrderedIssuer:
    """Issues follow-up collectives on a group of their own, in the order their slots were reserved.

    A hook issues its first collectives directly, on DDP's thread, in bucket order: the same on
    every rank, and interleaved correctly with DDP's own collectives on that group (DDP, for
    example, allreduces its map of used parameters right after the last bucket's hook). A
    follow-up collective (one that needs the result of an earlier one) can only be started from
    a future callback, on whatever thread completed that future, so it cannot safely share a
    group with anyone. It goes to :attr:`group`, a second group with the same ranks that only
    follow-ups use, and waits there until every follow-up reserved before it has been started.
    The order of collectives therefore never depends on thread timing, on either group.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, borrowed: bool = False) -> None:
        """``borrowed``: ``group`` is owned elsewhere (the very group whose follow-ups these
        are, where :func:`follow_up_group` shares it) and is kept weakly, so that an issuer
        kept for it does not keep it alive once torch has destroyed it; otherwise the issuer
        owns its group."""
        self._group = None if borrowed else group
        self._borrowed: weakref.ref[dist.ProcessGroup] | None = None
        if borrowed and group is not None:
            self._borrowed = weakref.ref(group)
        self._lock = threading.RLock()
        self._reserved = 0
        self._next = 0
        self._ready: dict[int, Callable[[], None] | None] = {}  # None: released unused
        self._held: set[int] = set()
        self._draining = False

    @property
    def group(self) -> dist.ProcessGroup:
        """The group of the follow-ups: the only group a step may issue a collective on."""
        group = self._group
        if group is not None:
            return group
        if self._borrowed is None:
            raise RuntimeError(
                "OrderedIssuer: made without a group, so its steps cannot issue collectives; "
                "build it as OrderedIssuer(comm.follow_up_group(group))."
            )
        group = self._borrowed()
        if group is None:
            raise RuntimeError(
                "OrderedIssuer: its process group is gone (destroyed with "
                "torch.distributed.destroy_process_group); a hook on a new group gets an "
                "issuer of its own: register the hook again on the new group."
            )
        return group

    def reserve(self) -> int:
        """Claim the next slot. Call only from the hook's own thread."""
        with self._lock:
            slot = self._reserved
            self._reserved += 1
            return slot

    def start(self, slot: int, launch: Callable[[], None]) -> None:
        """Run ``launch`` (which issues one collective on :attr:`group`, or none) in its turn."""
        with self._lock:
            self._ready[slot] = launch
            self._drain()

    def _drain(self) -> None:
        """Run the ready steps in slot order, in a loop, never nested.

        A step's collective may complete at once (NCCL's futures do, and so does anything
        :func:`completed` makes); its callbacks then call :meth:`start` for the next slot from
        inside the step. That inner call only files its step, and this loop runs it next: a
        chain of any number of buckets costs one frame, where nested runs overflowed Python's
        stack (about 75 buckets), lost the callback and left DDP waiting forever. Runs under
        the lock, so only this thread can re-enter.
        """
        if self._draining:
            return
        self._draining = True
        try:
            while self._next in self._ready and self._next not in self._held:
                run = self._ready.pop(self._next)
                self._next += 1
                if run is not None:
                    run()
        finally:
            self._draining = False

    def then(
        self,
        after: "Future[Any]",
        step: Callable[[Any], "Future[T]"],
        devices: list[torch.device] | None = None,
        hold: bool = False,
    ) -> "Future[T]":
        """When ``after`` completes, run ``step(after.value())`` in a slot reserved now.

        ``step`` may compute, then issue at most one collective, on :attr:`group` only, and
        return a future (``completed(...)`` when it sends nothing). If ``after`` failed, the
        slot is released without running ``step`` and the error is passed on, so later
        follow-ups are not held back forever. A pipeline of one round (:meth:`rounds`) that
        runs wholly in its turn.
        """
        return self.rounds(after, (lambda value: Issue(lambda: step(value)),), devices, hold)

    def rounds(
        self,
        after: "Future[Any]",
        steps: Sequence[Round],
        devices: list[torch.device] | None = None,
        hold: bool = False,
        polled: bool = False,
    ) -> "Future[Any]":
        """Run ``steps`` as the rounds of one pipeline, each with a slot of its own, reserved now.

        Round ``i`` runs once the future before it (``after`` for the first, then the one
        round ``i - 1`` issued) has completed, on that future's value, at once, on the
        thread that completed it: it decides what to send, which needs no turn. It returns
        :class:`Finished` to end the pipeline there (its slot and the later ones are released
        unused: a round that only a rare case needs costs a reserved number, no callback), or
        :class:`Issue`, whose launch then issues one collective on :attr:`group` in the
        round's turn, so that every rank issues in the same order. The returned future holds
        the result of the last round, or of the one that finished. A failed collective or a
        round that raises releases the slots left and fails that future.

        ``devices`` are the CUDA devices of the tensors involved (:func:`future_devices`):
        the future returned is synchronised with the streams its value was produced on, and
        each round's stream waits for its input's (``Future.wait``).

        With ``hold``, the first round waits, even once ``after`` has completed, until a later
        slot is reserved without ``hold`` (see :func:`holds_follow_ups`), and then runs in its
        turn; the later rounds start after it anyway.

        With ``polled``, no callback is attached to ``after``: the first round runs when this
        thread calls :func:`poll` once ``after`` has completed.
        """
        with self._lock:
            first = self._reserved
            self._reserved += len(steps)
            if hold:
                self._held.add(first)
            else:  # every held slot is an earlier one
                self._held.clear()
        out: Future[Any] = new_future(devices)
        if polled:
            _polled().add(after, lambda done: self._run(done, first, steps, out))
        else:
            self._after(after, first, steps, out, hold)
        if not hold:
            with self._lock:
                self._drain()
        return out

    def _after(
        self,
        fut: "Future[Any]",
        slot: int,
        steps: Sequence[Round],
        out: "Future[Any]",
        held: bool = False,
    ) -> None:
        """Once ``fut`` completes, run round ``steps[0]`` (the rest after it), in ``slot``."""

        def on_done(done: "Future[Any]") -> None:
            try:
                done.value()
            except BaseException as exc:  # forwarded to the caller's future
                self._release(slot, len(steps))
                fail(out, exc)
                return
            if held:  # decided in its turn too: see holds_follow_ups
                self.start(slot, lambda: self._run(done, slot, steps, out, in_turn=True))
            else:
                self._run(done, slot, steps, out)

        when_done(fut, on_done)

    def _run(
        self,
        done: "Future[Any]",
        slot: int,
        steps: Sequence[Round],
        out: "Future[Any]",
        in_turn: bool = False,
    ) -> None:
        """Run round ``steps[0]`` on ``done``'s value, then finish, or issue in its turn
        (``in_turn``: this is its turn, the slot taken already)."""
        left = slot + 1 if in_turn else slot  # the first slot still to start
        try:
            result = steps[0](done.wait())  # wait(): this stream waits for the input's
        except BaseException as exc:
            self._release(left, slot + len(steps) - left)
            fail(out, exc)
            return
        if isinstance(result, Finished):
            self._release(left, slot + len(steps) - left)
            out.set_result(result.value)
        elif in_turn:
            self._launch(result, slot, steps, out)
        else:
            self.start(slot, lambda: self._launch(result, slot, steps, out))

    def _launch(self, issue: Issue, slot: int, steps: Sequence[Round], out: "Future[Any]") -> None:
        """In ``slot``'s turn: issue the round's collective, and hand its future on."""
        try:
            sent = issue.launch()
        except BaseException as exc:
            self._release(slot + 1, len(steps) - 1)
            fail(out, exc)
            return
        if isinstance(sent, Finished):  # the launch found nothing to send after all
            self._release(slot + 1, len(steps) - 1)
            out.set_result(sent.value)
        elif len(steps) > 1:
            self._after(sent, slot + 1, steps[1:], out)
        elif sent.done():  # completed inline (NCCL) or sent nothing: no callback needed
            _forward(sent, out)
        else:
            when_done(sent, lambda fut: _forward(fut, out))

    def _release(self, slot: int, count: int) -> None:
        """Let ``count`` slots from ``slot`` on pass without issuing anything."""
        with self._lock:
            for unused in range(slot, slot + count):
                self._ready[unused] = None
            if slot == self._next:  # else an earlier slot is still to start: nothing can run
                self._drain()

    @property
    def pending(self) -> int:
        """Slots reserved but not started yet (0 between steps)."""
        with self._lock:
            return self._reserved - self._next


def _forward(src: "Future[T]", dst: "Future[Any]") -> None:
    try:
        value = src.value()
    except BaseException as exc:
        fail(dst, exc)
        return
    dst.set_result(value)


class IssuerPool:
    """One :class:`OrderedIssuer` per group, for the hooks (or states) that share it.

    Sharing is safe where the sharers reserve their slots one after another, in the same order
    on every rank (on one thread, or on threads that take turns, as DDP's backward and the
    training loop's optimizer step do), and cheaper: on gloo each issuer's follow-up group is
    a group of its own, with its own connections and threads. Kept by the group itself, weakly:
    an issuer goes when its group does (for example after ``dist.destroy_process_group``).
    """

    def __init__(self) -> None:
        self._issuers: weakref.WeakKeyDictionary[dist.ProcessGroup, OrderedIssuer] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    def issuer(self, group: dist.ProcessGroup) -> OrderedIssuer:
        """The issuer of ``group``'s follow-ups. The first call for a group creates its
        follow-up group (:func:`follow_up_group`, collective): make it at the same point on
        every rank."""
        issuer = self._issuers.get(group)  # once made, read without the lock (a bucket's call)
        if issuer is not None:
            return issuer
        with self._lock:
            issuer = self._issuers.get(group)
            if issuer is None:
                follow_up = follow_up_group(group)
                # Where the follow-ups share the group (NCCL's), the issuer must not hold it:
                # the pool keeps it only while the group lives.
                issuer = OrderedIssuer(follow_up, borrowed=follow_up is group)
                self._issuers[group] = issuer
            return issuer


_stateless_issuers = IssuerPool()


def _completes_inline(group: dist.ProcessGroup) -> bool:
    """Whether every collective of ``group`` completes its future as it is issued (NCCL's
    way; so does any group inside :func:`completing_inline`)."""
    return _inline or str(dist.get_backend(group)).lower() == "nccl"


def issuer_for(group: dist.ProcessGroup) -> OrderedIssuer:
    """The follow-up issuer of ``group``, shared by the stateless hooks that communicate on it.

    A hook with a state of its own owns its issuer instead
    (``OrderedIssuer(follow_up_group(group))``). The first call for a group creates the
    follow-up group (same ranks and backend as ``group``). Creating a group is itself
    collective, so the first call must happen at the same point on every rank: hooks call this
    from DDP's thread, during their first bucket. With NCCL the new communicator is only set up
    if a follow-up is ever sent on it.
    """
    return _stateless_issuers.issuer(group)


def follow_up_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """The group an :class:`OrderedIssuer` issues ``group``'s follow-ups on.

    On a group of NCCL alone, ``group`` itself: NCCL completes a collective's future as it is
    queued, so every callback, and with it every follow-up, runs on the thread that issued the
    collective before it, DDP's, in the same order on every rank, interleaved with DDP's own
    collectives alike. No second communicator then, and no group made inside a hook: with NCCL
    initialised eagerly (``init_process_group(device_id=...)``) torch makes each new group by
    splitting the default group's communicator, which every rank of the world must join, and
    the ranks outside a subgroup never run its hook.

    Otherwise (gloo, whose callbacks run on its worker threads) a new group with ``group``'s
    ranks, backend and timeout. Creating a group is collective: call it at the same point on
    every rank of ``group``. It waits for the other ranks at most ``group``'s timeout (see
    :func:`group_timeout`), and so does every collective on the new group.
    """
    if _completes_inline(group):
        return group
    made = dist.new_group(
        ranks=dist.get_process_group_ranks(group),
        backend=dist.get_backend(group),
        timeout=group_timeout(group),
        use_local_synchronization=True,
    )
    if made is None:  # only for a rank outside the ranks, which calls this never
        raise RuntimeError("follow_up_group: this rank is not in the group it was given.")
    return cast(dist.ProcessGroup, made)
