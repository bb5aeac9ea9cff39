"""The collectives the hooks issue, as torch.distributed's own, returning futures.

Every collective is the backend's (gloo, NCCL), issued with ``async_op=True`` as PyTorch's
hooks issue theirs, and counted by :func:`observe_collectives` as the kind a cost model prices.
:func:`completing_inline` is the test seam that makes any backend's futures complete as they
are returned, as NCCL's do, so that a CPU test runs a GPU's control flow.
"""

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = [
    "EXCHANGE_PIECES",
    "CollectiveCounter",
    "all_gather_into",
    "all_to_all",
    "allreduce",
    "allreduce_then",
    "average",
    "backend_for_device",
    "chain",
    "completed",
    "completes_inline",
    "completing_inline",
    "crosses_machines",
    "exchange_pieces",
    "fail",
    "future_devices",
    "new_future",
    "observe_collectives",
    "pieces_for",
    "reduce_scatter",
    "size",
    "then",
    "used_on_current_stream",
]

T = TypeVar("T")
S = TypeVar("S")
Opts = TypeVar("Opts")
Future = torch.futures.Future


# -- futures -------------------------------------------------------------------------------------
def future_devices(*values: Any) -> list[torch.device]:
    """The CUDA devices of the tensors in ``values``: a future made with them records an event
    on each device's stream when its result is set, which whoever waits on it (DDP included)
    waits for; without them, a consumer could read tensors whose kernels are still queued."""
    found: dict[str, torch.device] = {}
    for value in values:
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor) and t.is_cuda:
                found[str(t.device)] = t.device
    return list(found.values())


def new_future(devices: Sequence[torch.device] | None = None) -> "Future[Any]":
    """A future to complete by hand, synchronised with the streams of ``devices`` if any."""
    return Future(devices=list(devices)) if devices else Future()


def completed(value: T) -> "Future[T]":
    """A future already holding ``value``: what a hook that sends nothing returns."""
    fut: Future[T] = new_future(future_devices(value))
    fut.set_result(value)
    return fut


def then(fut: "Future[S]", fn: Callable[["Future[S]"], T]) -> "Future[T]":
    """``fut.then(fn)``: one name for every callback the package hands a future."""
    return fut.then(fn)


def fail(fut: "Future[Any]", exc: BaseException) -> None:
    """Complete ``fut`` with the error ``exc`` (torch's stubs type the error as the value)."""
    fut.set_exception(exc)


def chain(src: "Future[T]", dst: "Future[T]") -> None:
    """Complete ``dst`` with ``src``'s value, or its error, once ``src`` is done."""

    def forward(done: "Future[T]") -> None:
        try:
            value = done.value()
        except BaseException as exc:
            fail(dst, exc)
            return
        dst.set_result(value)

    src.add_done_callback(forward)


def used_on_current_stream(tensors: Sequence[torch.Tensor]) -> None:
    """Mark the CUDA tensors among ``tensors`` used on the current stream, so that their memory
    is not reused before its kernels ran: tensors made on DDP's stream, last used in a callback
    on another."""
    for t in tensors:
        if t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))


# -- the test seam -------------------------------------------------------------------------------
_inline = False


@contextlib.contextmanager
def completing_inline() -> Iterator[None]:
    """Within this block, collectives behave as NCCL's do, on any backend: for testing.

    Every collective's future is complete when it is returned (as NCCL's once queued, so a
    callback runs at once, on the issuing thread), and follow-ups share the hook's group.
    Process-wide; not for use while another thread issues collectives.
    """
    global _inline
    before, _inline = _inline, True
    try:
        yield
    finally:
        _inline = before


def completes_inline() -> bool:
    """Whether :func:`completing_inline` is in force."""
    return _inline


def _issued(work: Any) -> "Future[list[torch.Tensor]]":
    """The future of a collective's ``work``; within :func:`completing_inline`, complete."""
    fut: Future[list[torch.Tensor]] = work.get_future()
    if not _inline or fut.done():
        return fut
    try:
        return completed(fut.wait())
    except BaseException:  # a failed collective: its future holds the error already
        return fut


# -- observing what is sent ----------------------------------------------------------------------
class CollectiveCounter:
    """Calls and bytes handed to each kind of collective while an observer was open: this
    rank's inputs, not what crosses the wire (the cost model's business)."""

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
# kind counted, and the argument (position, name) holding what this rank hands over. Recent
# PyTorch renames two (``*_single``; the old names warn), counted as the same kinds.
_TORCH_COLLECTIVES: dict[str, tuple[str, int, str]] = {
    "all_reduce": ("all_reduce", 0, "tensor"),
    "broadcast": ("broadcast", 0, "tensor"),
    "all_gather": ("all_gather", 1, "tensor"),
    "all_gather_into_tensor": ("all_gather_into_tensor", 1, "input_tensor"),
    "all_gather_single": ("all_gather_into_tensor", 1, "input_tensor"),
    "reduce_scatter_tensor": ("reduce_scatter_tensor", 1, "input"),
    "reduce_scatter_single": ("reduce_scatter_tensor", 1, "input"),
    "all_to_all_single": ("all_to_all_single", 1, "input"),
}
_counters: list[CollectiveCounter] = []
_originals: dict[str, Callable[..., Any]] = {}
_lock = threading.Lock()


@contextlib.contextmanager
def observe_collectives(*, torch_calls: bool = False) -> Iterator[CollectiveCounter]:
    """Count the collectives this process issues while inside, per kind, on every thread.

    Args:
        torch_calls: also count calls made straight to ``torch.distributed`` (PyTorch's own
            hooks, a user's): its functions are wrapped, process-wide, meanwhile. DDP's own
            allreduce, issued from C++, is never seen.

    Yields:
        the counter, complete once the block is left.
    """
    counter = CollectiveCounter(torch_calls)
    with _lock:
        _counters.append(counter)
        if torch_calls and not _originals:
            _wrap_torch()
    try:
        yield counter
    finally:
        with _lock:
            _counters.remove(counter)
            if _originals and not any(c.torch_calls for c in _counters):
                for name, original in _originals.items():
                    setattr(dist, name, original)
                _originals.clear()


def _wrap_torch() -> None:
    for name, (kind, position, keyword) in _TORCH_COLLECTIVES.items():
        original = getattr(dist, name, None)
        if original is not None:
            _originals[name] = original
            setattr(dist, name, _counting(kind, position, keyword, original))


def _counting(
    kind: str, position: int, keyword: str, original: Callable[..., Any]
) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        given = args[position] if len(args) > position else kwargs.get(keyword)
        _observed(kind, given, direct=True)
        return original(*args, **kwargs)

    counted.__wrapped__ = original  # type: ignore[attr-defined]
    return counted


def _observed(kind: str, handed: Any, direct: bool = False) -> None:
    """Report a collective to the open observers (``direct`` ones to those that asked)."""
    nbytes = handed.numel() * handed.element_size() if isinstance(handed, torch.Tensor) else 0
    for counter in list(_counters):
        if counter.torch_calls or not direct:
            counter.record(kind, nbytes)


def _torch(name: str, older: str | None = None) -> Callable[..., Any]:
    """torch.distributed's ``name`` unwrapped (what this module issues it counts itself), or
    ``older`` where this torch has no ``name`` yet."""
    for found in (name, older):
        if found is not None and hasattr(dist, found):
            return _originals.get(found) or getattr(dist, found)
    raise AttributeError(f"torch.distributed has neither {name} nor {older}")


def _options(kind: Callable[[], Opts]) -> Opts:
    """Options with ``asyncOp`` set where this torch has the field (2.7 on)."""
    options = kind()
    if hasattr(options, "asyncOp"):
        options.asyncOp = True
    return options


_SUM = _options(dist.AllreduceOptions)
_SUM.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
_EXCHANGE = _options(dist.AllToAllOptions)


# -- the collectives -----------------------------------------------------------------------------
# Issued on the group itself (its public ``allreduce`` and ``alltoall_base``): the backend's
# own collective, as ``dist.all_reduce`` issues it, without that function's checks of a group
# resolved already, which cost the host a few microseconds a bucket.
def _allreduce(tensor: torch.Tensor, group: dist.ProcessGroup) -> "Future[list[torch.Tensor]]":
    if _counters:
        _observed("all_reduce", tensor)
    if tensor.layout != torch.strided or tensor.is_complex():  # dist's conversions needed
        work = _torch("all_reduce")(tensor, group=group, async_op=True)
    else:
        work = group.allreduce([tensor], _SUM)
    return _issued(work)


def allreduce(tensor: torch.Tensor, group: dist.ProcessGroup) -> "Future[torch.Tensor]":
    """Sum ``tensor`` in place across ``group``; the future holds the sum (for a sparse
    tensor, the one gloo returns)."""
    return _allreduce(tensor, group).then(lambda fut: fut.value()[0])


def allreduce_then(
    tensor: torch.Tensor, group: dist.ProcessGroup, fn: Callable[[torch.Tensor], T]
) -> "Future[T]":
    """:func:`allreduce`, then ``fn`` on the sum in the one callback (a second would cost the
    host once a bucket); the future holds what ``fn`` returns."""
    return _allreduce(tensor, group).then(lambda fut: fn(fut.value()[0]))


def average(tensor: torch.Tensor, group: dist.ProcessGroup) -> "Future[torch.Tensor]":
    """Average ``tensor`` in place across ``group``, scaled before the sum with DDP's own
    arithmetic (a dense tensor times ``1 / world_size``, a sparse one divided): bitwise what
    DDP gives without a hook."""
    world = size(group)
    if tensor.layout == torch.strided:
        tensor.mul_(1.0 / world)
    else:
        tensor.div_(world)
    return allreduce(tensor, group)


EXCHANGE_PIECES = 8
"""How many collectives a large exchange on gloo is issued as (:func:`exchange_pieces`)."""
PIECE_MIN_BYTES = 64 * 1024
"""The smallest piece worth a collective of its own."""


_across: "weakref.WeakSet[dist.ProcessGroup]" = weakref.WeakSet()


def crosses_machines(group: dist.ProcessGroup) -> None:
    """Mark ``group`` as one whose ranks are on several machines: its large exchanges on gloo
    then go in pieces (:func:`exchange_pieces`). Within a machine an exchange stays whole:
    there is no slow link to share, and each piece is a collective to issue (on loopback, up
    to 15 ms a step for int4 on a model of 6M parameters)."""
    _across.add(group)


def exchange_pieces(nbytes: float, backend: str) -> int:
    """How many collectives an all-to-all or all-gather of ``nbytes`` a rank is issued as.

    gloo's sends are rendezvous: a rank sends once its peer's notice that it is ready to
    receive has arrived, and that notice travels behind whatever the peer is already sending
    on the same connection. Between two ranks the one that arrives second sends its whole
    payload before its notice, and the link's two directions take turns. Issued as
    :data:`EXCHANGE_PIECES` collectives at once, only the first piece waits so, and the rest
    run both ways: at 100 Mbit/s between two network namespaces, an exchange of 3-6 MB a rank
    took up to 1.6-1.8x its bytes' time whole and 1.06-1.2x in eight pieces
    (``examples/exchange_pieces.py``). Small exchanges, and every other backend, stay whole.
    """
    if backend != "gloo" or nbytes < EXCHANGE_PIECES * PIECE_MIN_BYTES:
        return 1
    return EXCHANGE_PIECES


def all_to_all(
    out: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup
) -> "Future[torch.Tensor]":
    """Send row ``i`` of ``tensor`` to rank ``i``; row ``j`` of ``out`` comes from rank ``j``
    (both ``world_size x ...``, contiguous); the future holds ``out``. On one rank: at once."""
    if size(group) == 1:
        return _kept_here(out, tensor)
    if _counters:
        _observed("all_to_all_single", tensor)
    return _exchange(out, tensor, group)


def _exchange(
    out: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup
) -> "Future[torch.Tensor]":
    """:func:`all_to_all`, in :func:`exchange_pieces` pieces: each a slice of every row."""
    pieces = pieces_for(tensor, group)
    if pieces == 1:
        work = group.alltoall_base(out, tensor, [], [], _EXCHANGE)
        return _issued(work).then(lambda fut: _checked(fut, out))
    # A piece is a slice of every row: copied out of the rows and back (the exchange's bytes
    # once more on the host, small beside what the turns cost on a slow link).
    rows = out.view(size(group), -1)
    sent = [part.contiguous() for part in tensor.view(rows.shape).tensor_split(pieces, dim=1)]
    got = [torch.empty_like(part) for part in sent]
    works = [group.alltoall_base(o, i, [], [], _EXCHANGE) for o, i in zip(got, sent)]
    return _joined(works, out, lambda: torch.cat(got, dim=1, out=rows))


def all_gather_into(
    out: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup
) -> "Future[torch.Tensor]":
    """Row ``j`` of ``out`` (``world_size x tensor.numel()``) becomes rank ``j``'s ``tensor``,
    in :func:`exchange_pieces` pieces; the future holds ``out``."""
    world = size(group)
    if world == 1:
        return _kept_here(out, tensor)
    if _counters:
        _observed("all_gather_into_tensor", tensor)
    # all_gather_single: the name of recent PyTorch, where the old one warns at every call.
    gather = _torch("all_gather_single", "all_gather_into_tensor")
    pieces = pieces_for(tensor, group)
    if pieces == 1:
        work = gather(out.view(-1), tensor.view(-1), group=group, async_op=True)
        return _issued(work).then(lambda fut: _checked(fut, out))
    sent = list(tensor.view(-1).tensor_split(pieces))
    got = [part.new_empty(world * part.numel()) for part in sent]
    works = [gather(o, i, group=group, async_op=True) for o, i in zip(got, sent)]
    rows = out.view(world, -1)
    return _joined(works, out, lambda: torch.cat([g.view(world, -1) for g in got], 1, out=rows))


def pieces_for(tensor: torch.Tensor, group: dist.ProcessGroup) -> int:
    """The collectives an all-to-all or all-gather of ``tensor`` over ``group`` is issued as:
    one, unless ``group`` was marked by :func:`crosses_machines`."""
    if group not in _across:
        return 1
    nbytes = tensor.numel() * tensor.element_size()
    return exchange_pieces(nbytes, backend_for_device(group, tensor.device.type))


def _joined(
    works: list[Any], out: torch.Tensor, assemble: Callable[[], object]
) -> "Future[torch.Tensor]":
    """One future for the pieces' ``works``, holding ``out`` once ``assemble()`` has put the
    pieces in it; or the first piece's error."""
    futures = [_issued(work) for work in works]

    def done(_: Any) -> torch.Tensor:
        for fut in futures:
            fut.value()  # raises here if a piece failed
        assemble()
        return out

    return torch.futures.collect_all(futures).then(done)


def reduce_scatter(
    out: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup
) -> "Future[torch.Tensor]":
    """``out`` becomes the sum over ``group`` of part ``i`` of ``tensor`` on rank ``i``; the
    future holds ``out``. gloo's reduce-scatter has no future to wait on without blocking:
    there it is an all-to-all of the parts (the same bytes) and their sum."""
    world = size(group)
    if world == 1:
        return _kept_here(out, tensor)
    if _counters:
        _observed("reduce_scatter_tensor", tensor)
    if backend_for_device(group, tensor.device.type) != "gloo":
        scatter = _torch("reduce_scatter_single", "reduce_scatter_tensor")
        work = scatter(out, tensor, group=group, async_op=True)
        return _issued(work).then(lambda fut: _checked(fut, out))
    parts = torch.empty_like(tensor).view(world, -1)
    exchanged = _exchange(parts, tensor.view(world, -1), group)
    return exchanged.then(lambda fut: torch.sum(fut.value(), dim=0, out=out.view(-1)))


def backend_for_device(group: dist.ProcessGroup | None, device_type: str) -> str:
    """The backend ``group`` uses for tensors on ``device_type`` (``"gloo"``, ``"nccl"``...).

    A group initialised as ``"cpu:gloo,cuda:nccl"`` reports each device's backend, as does one
    initialised without a backend (``init_process_group()``, whose backend is ``"undefined"``:
    its devices' backends are in its config); a plain ``"gloo"`` group serves every device.
    """
    name = str(dist.get_backend(group)).lower()
    if name == "undefined" and hasattr(dist, "get_backend_config"):
        name = str(dist.get_backend_config(group)).lower()
    if ":" not in name:
        return name
    pairs = dict(part.split(":", 1) for part in name.split(",") if ":" in part)
    return pairs.get(device_type, next(iter(pairs.values())))


_sizes: "weakref.WeakKeyDictionary[dist.ProcessGroup, int]" = weakref.WeakKeyDictionary()


def size(group: dist.ProcessGroup) -> int:
    """``group.size()``, remembered: asking the backend costs a microsecond a bucket."""
    known = _sizes.get(group)
    if known is None:
        known = _sizes[group] = group.size()
    return known


def _checked(fut: "Future[Any]", out: torch.Tensor) -> torch.Tensor:
    fut.value()  # raises here if the collective failed
    return out


def _kept_here(out: torch.Tensor, tensor: torch.Tensor) -> "Future[torch.Tensor]":
    """A one-rank exchange: ``tensor``'s elements in ``out``."""
    if out.data_ptr() != tensor.data_ptr():
        out.view(-1).copy_(tensor.reshape(-1))
    return completed(out)
