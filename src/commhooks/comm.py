"""Every call into ``torch.distributed`` made by the package lives here.

Hooks and averagers describe *what* to communicate; this module decides *how* it is issued.
Keeping the collectives in one place lets us guarantee the property DDP silently relies on:
every rank issues the same collectives in the same order. PyTorch's PowerSGD breaks that on gloo
by starting follow-up collectives from future callbacks, which run on the backend's worker
threads in a different order on each rank. :class:`OrderedIssuer` fixes it by starting
collectives in the order their slots were reserved, whichever thread gets there first.
"""

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

__all__ = [
    "OrderedIssuer",
    "all_gather_objects",
    "allreduce",
    "average",
    "backend_for_device",
    "check_same_on_all_ranks",
    "check_same_on_grid",
    "completed",
    "follow_up_group",
    "follow_up_options",
    "future_devices",
    "new_future",
    "gather_objects",
    "group_rank",
    "is_default_group",
    "global_ranks",
    "holds_follow_ups",
    "is_world",
    "issuer_for",
    "new_groups",
    "resolve_group",
    "unheld_follow_ups",
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
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{owner} needs torch.distributed: call torch.distributed.init_process_group(...) "
            "before the first backward pass."
        )
    if group is None:
        return _world()
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
    # Typed as optional by torch: it is None only before init_process_group.
    return cast(dist.ProcessGroup, dist.group.WORLD)


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


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank inside ``group``."""
    return dist.get_rank(group)


def is_world(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` is the default group (``None`` counts as the default group)."""
    return group is None or group is dist.group.WORLD


def global_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """The global ranks of ``group``'s members, in group-rank order."""
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def new_groups(rank_lists: list[list[int]]) -> list[dist.ProcessGroup | None]:
    """Create one process group per list of global ranks, in the order given.

    Creating a group is a collective over the default group: every rank must call this with the
    same lists in the same order, including ranks that belong to none of them. A list that is
    the whole world reuses the default group instead of opening new connections.

    Returns:
        one entry per list: the group where this rank is a member, ``None`` where it is not.
    """
    world = dist.get_world_size()
    me = dist.get_rank()
    out: list[dist.ProcessGroup | None] = []
    for ranks in rank_lists:
        if sorted(ranks) == list(range(world)):
            out.append(dist.group.WORLD)
            continue
        group = dist.new_group(ranks=sorted(ranks))
        out.append(group if me in ranks else None)
    return out


def future_devices(*values: Any) -> list[torch.device]:
    """The CUDA devices of the tensors in ``values``: what a future holding them must know.

    A future created here with those devices records, when its result is set, an event on
    each device's current stream, and whoever waits on it (DDP included) makes its own stream
    wait for that event. A future that does not know them hands over tensors whose kernels may
    still be queued on another stream: on a GPU, the consumer would read them half written.
    """
    found: dict[str, torch.device] = {}
    for value in values:
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                found[str(t.device)] = t.device
    return list(found.values())


def new_future(devices: list[torch.device] | None = None) -> "Future[Any]":
    """A future to complete by hand, synchronised with the streams of ``devices`` if any."""
    wanted: list[int | str | torch.device] = list(devices or ())
    return Future(devices=wanted) if wanted else Future()


_calling = threading.local()


@contextlib.contextmanager
def unheld_follow_ups() -> Iterator[None]:
    """Within this block, hooks called on this thread never hold their follow-ups.

    For callers that wait for each hook's result before they call the next one (FSDP2's
    all-reduce hook must hand its shard back averaged): a follow-up held until a later bucket
    would then never run.
    """
    before = getattr(_calling, "unheld", False)
    _calling.unheld = True
    try:
        yield
    finally:
        _calling.unheld = before


def holds_follow_ups(devices: list[torch.device]) -> bool:
    """Whether a hook holds its follow-ups until the step's last bucket (on a GPU).

    A follow-up reads a check back to the host, which waits until the device has caught up.
    NCCL completes a collective's future as soon as it is queued, so a follow-up runs on DDP's
    thread right away: reading there would stop the backward pass from being queued further, at
    every bucket, and with it the overlap of communication and computation. Held until the last
    bucket (the whole backward pass is queued by then), the first read waits once and the others
    find the device idle. On CPU a read waits for nothing, and follow-ups run when they can.
    Never inside :func:`unheld_follow_ups`.
    """
    return bool(devices) and not getattr(_calling, "unheld", False)


def follow_up_options(buffer: torch.Tensor, last_bucket: bool) -> tuple[list[torch.device], bool]:
    """What a hook passes to :meth:`OrderedIssuer.then` for a follow-up on ``buffer``'s bucket:
    the CUDA devices involved, and whether the follow-up is held (every bucket but the last,
    on a GPU; see :func:`holds_follow_ups`)."""
    devices = future_devices(buffer)
    return devices, holds_follow_ups(devices) and not last_bucket


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


# Up to this size, two gloo ranks sum a tensor faster by exchanging it whole (one all-gather and
# a local add) than with gloo's allreduce, whose rounds each wait on the other rank. At two
# ranks both send the same bytes, and the sums are the same bits (addition commutes).
_EXCHANGE_BYTES = 1 << 20


def allreduce(tensor: torch.Tensor, group: dist.ProcessGroup) -> "Future[torch.Tensor]":
    """Sum ``tensor`` in place across ``group``; the future resolves to ``tensor`` itself.

    One collective either way: an allreduce, or for a small CPU tensor on two gloo ranks an
    all-gather and a local add (see ``_EXCHANGE_BYTES``), which returns sooner, most of all
    in the slow tail; PowerSGD's factors are such tensors.
    """
    if _sums_by_exchange(tensor, group):
        return _exchange_and_add(tensor, group)
    work = dist.all_reduce(tensor, group=group, async_op=True)
    summed: Future[torch.Tensor] = work.get_future().then(_first)
    return summed


def _sums_by_exchange(tensor: torch.Tensor, group: dist.ProcessGroup) -> bool:
    return (
        group.size() == 2
        and tensor.device.type == "cpu"
        and tensor.is_floating_point()
        and tensor.numel() * tensor.element_size() <= _EXCHANGE_BYTES
        and "gloo" in str(dist.get_backend(group))
    )


def _exchange_and_add(tensor: torch.Tensor, group: dist.ProcessGroup) -> "Future[torch.Tensor]":
    # The choice above must not depend on anything that may differ between ranks, such as a
    # tensor's strides: one that is not contiguous is sent from a copy.
    flat = tensor.reshape(-1) if tensor.is_contiguous() else tensor.flatten()
    both = flat.new_empty(2 * flat.numel())
    # Renamed in recent PyTorch, where the old name warns on every call.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work = gather(both, flat, group=group, async_op=True)

    def add(fut: "Future[Any]") -> torch.Tensor:
        fut.value()  # raises here if the all-gather failed
        # The same order on both ranks, so they hold the same bits.
        torch.add(both[: flat.numel()], both[flat.numel() :], out=flat)
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))
        return tensor

    added: Future[torch.Tensor] = work.get_future().then(add)
    return added


def average(tensor: torch.Tensor, group: dist.ProcessGroup) -> "Future[torch.Tensor]":
    """Average ``tensor`` in place across ``group``.

    Scaling happens before the sum, as DDP itself does, so the partial sums stay in range. We
    multiply by ``1 / world_size`` rather than divide because that is DDP's own arithmetic:
    results are bitwise identical to training without a hook, at any world size.
    """
    tensor.mul_(1.0 / group.size())
    return allreduce(tensor, group)


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


def check_same_on_all_ranks(
    options: dict[str, Any], group: dist.ProcessGroup | None, *, owner: str
) -> None:
    """Raise if any option differs between ranks.

    Ranks configured differently would issue collectives of different shapes, which gloo
    reports as an abort and NCCL as a hang. One small gather, done once, turns that into a
    readable error naming the option.

    Raises:
        ValueError: naming each differing option and its value on every rank.
    """
    everyone = all_gather_objects(options, group)
    _raise_if_differing(dict(enumerate(everyone)), owner)


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

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self._lock = threading.RLock()
        self._reserved = 0
        self._next = 0
        self._ready: dict[int, Callable[[], None]] = {}
        self._held: set[int] = set()

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
        while self._next in self._ready and self._next not in self._held:
            run = self._ready.pop(self._next)
            self._next += 1
            run()

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
        follow-ups are not held back forever.

        ``devices`` are the CUDA devices of the tensors involved (:func:`future_devices`).
        ``step`` may run later, on another thread than the one ``after`` completed on, so its
        stream is made to wait for ``after`` there; the future returned is synchronised with
        the streams ``step``'s result was produced on.

        With ``hold``, ``step`` waits, even once ``after`` has completed, until a later slot is
        reserved without ``hold``; held steps then run first, in order (see
        :func:`holds_follow_ups`).
        """
        with self._lock:
            slot = self.reserve()
            if hold:
                self._held.add(slot)
            else:  # every held slot is an earlier one
                self._held.clear()
        out: Future[T] = new_future(devices)

        def on_done(fut: "Future[Any]") -> None:
            try:
                fut.value()
            except BaseException as exc:  # forwarded to the caller's future
                self.start(slot, lambda: None)
                out.set_exception(exc)  # type: ignore[arg-type]  # torch's stub: a result type
                return
            self.start(slot, lambda: _launch_into(lambda: step(fut.wait()), out))

        after.add_done_callback(on_done)
        if not hold:
            with self._lock:
                self._drain()
        return out

    @property
    def pending(self) -> int:
        """Slots reserved but not started yet (0 between steps)."""
        with self._lock:
            return self._reserved - self._next


def _launch_into(issue: Callable[[], "Future[T]"], out: "Future[T]") -> None:
    try:
        inner = issue()
    except BaseException as exc:
        out.set_exception(exc)  # type: ignore[arg-type]  # torch's stub: a result type
        return
    inner.add_done_callback(lambda fut: _forward(fut, out))


def _forward(src: "Future[T]", dst: "Future[T]") -> None:
    try:
        value = src.value()
    except BaseException as exc:
        dst.set_exception(exc)  # type: ignore[arg-type]  # torch's stub: a result type
        return
    dst.set_result(value)


_issuers: dict[int, tuple[dist.ProcessGroup, OrderedIssuer]] = {}
_issuers_lock = threading.Lock()


def issuer_for(group: dist.ProcessGroup) -> OrderedIssuer:
    """The follow-up issuer of ``group``, shared by every hook that communicates on it.

    The first call creates the follow-up group (same ranks and backend as ``group``). Creating
    a group is itself collective, so the first call must happen at the same point on every
    rank: hooks call this from DDP's thread, during their first bucket. With NCCL the new
    communicator is only set up if a follow-up is ever sent on it.
    """
    with _issuers_lock:
        entry = _issuers.get(id(group))
        if entry is None or entry[0] is not group:
            entry = (group, OrderedIssuer(follow_up_group(group)))
            _issuers[id(group)] = entry
        return entry[1]


def follow_up_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A new group with ``group``'s ranks and backend, for an :class:`OrderedIssuer` of its own.

    Creating a group is collective: call it at the same point on every rank of ``group``.
    """
    follow_up: dist.ProcessGroup = dist.new_group(
        ranks=dist.get_process_group_ranks(group),
        backend=dist.get_backend(group),
        use_local_synchronization=True,
    )
    return follow_up
