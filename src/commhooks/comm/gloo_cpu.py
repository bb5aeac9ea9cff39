"""Collectives on gloo with CPU tensors, made faster than gloo's own: for :mod:`commhooks.comm`.

Nothing here is needed for correctness, and nothing runs on any other backend or device.
:mod:`commhooks.comm` hands each collective to the function of the same name here first:
:func:`allreduce` (two ranks summing a tensor by exchanging it, added as it arrives),
:func:`all_to_all` and :func:`all_gather_into` (point-to-point messages with every receive
posted first); each returns ``None`` for a tensor and group it does not take (:func:`sums`,
:func:`takes`), and the caller issues the backend's collective. gloo's send and receive
works only block, so each group gets a thread of its own that waits for them and completes
the futures handed back (:class:`_Waiter`), ended at interpreter exit and forgotten in a
forked child. A bfloat16 chunk is added by the CPU kernel of :mod:`commhooks.compress.cpu_kernels`
where it is built.
"""

import atexit
import collections
import itertools
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from commhooks.comm._futures import fail
from commhooks.compress import cpu_kernels

__all__ = [
    "CHUNKS_IN_FLIGHT",
    "CHUNK_BYTES",
    "SMALL_BYTES",
    "all_gather_into",
    "all_to_all",
    "allreduce",
    "sums",
    "takes",
]

Future = torch.futures.Future
T = TypeVar("T")

# Two gloo ranks sum a floating-point tensor by sending it to each other and adding it where
# it arrives (:class:`_PairSum`), not with gloo's allreduce, which lets the two directions
# take turns as its all-to-all does (see :func:`_swap`) and adds half precision in scalar code.
# A tensor travels in chunks of at most ``CHUNK_BYTES``, received into ``CHUNKS_IN_FLIGHT``
# buffers that are reused: 4 MiB of scratch space at most (gloo's own allreduce takes 2 MiB for
# a large tensor), never a second copy of a gradient bucket. A rank may send a chunk only once
# the other has posted its receive, and word of that travels behind the data already queued in
# the same direction, so a link idles for a moment once per window of chunks in flight; eight
# rather than four made DDP's step with the fp16 hook 2% shorter on 100 Mbit/s (6M-parameter
# model, 25 MB buckets, steps interleaved with PyTorch's hook: 0.968-1.003x of its step time in
# four runs, mean 0.981, against 0.984-1.008x, mean 1.000, with four; bf16 0.965-0.990x against
# 0.990-1.019x). Measured with four in flight, medians of 15, 6M
# float16 elements on loopback: 11.8-13.4 ms against gloo's 23.0 ms (1 MiB chunks, two in
# flight: 11.6-13.5 ms; 256 KiB, eight: 13.4-16.0 ms); 1.5M: 3.8-4.6 against 5.9-6.0 ms. On a
# 100 Mbit/s link (medians of 7), 6M: 1066-1070 against 1087-1097 ms (1 MiB chunks: 1080-1086
# ms, 256 KiB: 1046-1055 ms); on 1 Gbit/s, 100.3-100.7 against 99.9-100.8 ms. A tensor of up
# to ``SMALL_BYTES`` in any floating-point dtype is exchanged too (64 KiB: 0.8 against 2.0
# ms; 898 KiB 1.6 against 4.4 ms). gloo adds float32 with vector instructions: the allreduce
# hook took 26.5 ms for a bucket of 6M float32 elements summed in chunks, PyTorch's 22.9 ms
# with gloo's allreduce, so larger float32 tensors stay with gloo. At two ranks the sum is
# one rounded addition per element: the same bits either way. bfloat16 chunks are added by a
# fused kernel where it is built (:mod:`commhooks.compress.cpu_kernels`), with torch.add's bits: torch
# converts bfloat16 to float and back in several integer operations per element.
CHUNK_BYTES = 1 << 19
CHUNKS_IN_FLIGHT = 8
SMALL_BYTES = 1 << 20
_HALVES = (torch.float16, torch.bfloat16)


def allreduce(
    tensor: torch.Tensor, group: dist.ProcessGroup
) -> "Future[list[torch.Tensor]] | None":
    """Sum ``tensor`` in place over ``group`` by an exchange where :func:`sums` says so; the
    future holds ``[tensor]`` once ``tensor`` holds the sum, as an allreduce work's future
    does. ``None`` where the caller issues an allreduce instead."""
    return _exchange_and_add(tensor, group) if sums(tensor, group) else None


def all_to_all(
    out: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup
) -> "Future[None] | None":
    """:func:`commhooks.comm.all_to_all` as point-to-point messages (:func:`_swap`) where
    :func:`takes` says so; the future completes once ``out`` is filled. ``None`` elsewhere."""
    if not takes(tensor, group):
        return None
    world, me = group.size(), group.rank()
    rows, received = tensor.view(world, -1), out.view(world, -1)
    swapped = _swap(list(rows), list(received), group)
    received[me].copy_(rows[me])
    return swapped


def all_gather_into(
    out: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup
) -> "Future[None] | None":
    """:func:`commhooks.comm.all_gather_into` as point-to-point messages (:func:`_swap`)
    where :func:`takes` says so; the future completes once ``out`` is filled. ``None``
    elsewhere."""
    if not takes(tensor, group):
        return None
    world, me = group.size(), group.rank()
    flat, rows = tensor.reshape(-1), out.view(world, -1)
    swapped = _swap([flat] * world, list(rows), group)
    rows[me].copy_(flat)
    return swapped


def sums(tensor: torch.Tensor, group: dist.ProcessGroup) -> bool:
    """Whether :func:`allreduce` sums ``tensor`` over ``group`` (else the caller issues one):
    two gloo ranks, a CPU tensor in half precision or of up to ``SMALL_BYTES`` in any
    floating-point dtype. Depends on nothing that may differ between ranks."""
    return (
        tensor.is_floating_point()
        and _is_pair(group)
        and (tensor.dtype in _HALVES or tensor.numel() * tensor.element_size() <= SMALL_BYTES)
        and takes(tensor, group)
    )


_pairs: "weakref.WeakKeyDictionary[dist.ProcessGroup, bool]" = weakref.WeakKeyDictionary()


def _is_pair(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` is two ranks on gloo, remembered (asked once a bucket, and neither can
    change for a group)."""
    known = _pairs.get(group)
    if known is None:
        known = _pairs[group] = group.size() == 2 and "gloo" in str(dist.get_backend(group))
    return known


def takes(tensor: torch.Tensor, group: dist.ProcessGroup) -> bool:
    """Whether ``tensor``'s all-to-all and all-gather on ``group`` run here, as point-to-point
    messages (:func:`_swap`): gloo with a dense CPU tensor."""
    return (
        tensor.device.type == "cpu"
        and tensor.layout == torch.strided
        and "gloo" in str(dist.get_backend(group))
    )


def _exchange_and_add(
    tensor: torch.Tensor, group: dist.ProcessGroup
) -> "Future[list[torch.Tensor]]":
    """Sum ``tensor`` in place over the two ranks of ``group`` by exchanging it (see
    ``CHUNK_BYTES``); the future holds ``[tensor]`` once this rank's sum is complete."""
    # The choice of :func:`sums` must not depend on anything that may differ between ranks,
    # such as a tensor's strides: one that is not contiguous is sent from a copy.
    flat = tensor.reshape(-1) if tensor.is_contiguous() else tensor.flatten()
    waiter = _waiter(group)
    pair = _PairSum(flat, group, waiter.new_tag())

    def finish() -> list[torch.Tensor]:
        pair.finish()
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))
        return [tensor]

    return waiter.run(finish)


class _PairSum:
    """The sum of a tensor over two ranks, each sending its tensor in chunks to the other.

    Made on the issuing thread, which posts the first receives and every send; finished on
    the group's waiter thread (:meth:`finish`), which adds each chunk as it arrives and posts
    the receive of a later chunk into the buffer it frees. Those late receives are why each
    sum has a tag of its own: the next sum's messages, posted meanwhile, cannot take them.
    A chunk is overwritten by the sum only once it has been sent.
    """

    def __init__(self, flat: torch.Tensor, group: dist.ProcessGroup, tag: int) -> None:
        me = group.rank()
        self.group, self.tag, self.first = group, tag, me == 0
        self.peer = dist.get_process_group_ranks(group)[1 - me]
        self.chunks = torch.split(flat, max(1, CHUNK_BYTES // flat.element_size()))
        spares = [torch.empty_like(chunk) for chunk in self.chunks[:CHUNKS_IN_FLIGHT]]
        self.receiving = collections.deque(
            self._receive(index, spare) for index, spare in enumerate(spares)
        )
        self.sending: list[Any] = [
            dist.isend(c, self.peer, group=group, tag=tag) for c in self.chunks
        ]

    def _receive(self, index: int, spare: torch.Tensor) -> tuple[Any, torch.Tensor]:
        into = spare[: self.chunks[index].numel()]
        return dist.irecv(into, self.peer, group=self.group, tag=self.tag), spare

    def finish(self) -> None:
        """Add every chunk of the other rank's tensor to this one's, as each arrives."""
        for index, chunk in enumerate(self.chunks):
            work, spare = self.receiving.popleft()
            work.wait()
            self.sending[index].wait()
            theirs = spare[: chunk.numel()]
            # The same order on both ranks, so they hold the same bits (the kernel gives every
            # NaN the same bits, so that its order does not matter).
            if not cpu_kernels.bfloat16_add_(chunk, theirs):
                torch.add(*((chunk, theirs) if self.first else (theirs, chunk)), out=chunk)
            later = index + CHUNKS_IN_FLIGHT
            if later < len(self.chunks):
                self.receiving.append(self._receive(later, spare))


# gloo's all-to-all and all-gather post each send before the matching receive, and a send
# only starts once the peer has said that its receive is posted. That word travels in the
# same TCP stream as the data, so a rank that arrives second queues its whole message ahead
# of it: the first rank's message waits until the second's has crossed the link, and the two
# directions take turns instead of sharing it. Two ranks exchanging 3 MB each way, 100 Mbit/s
# link (257 ms of bytes): 499 ms by all_to_all_single, 258-274 ms with every receive posted
# before any send; 1 Gbit/s: 51 against 26 ms. The tag keeps these messages apart from a
# user's own point-to-point traffic on the group.
_SWAP_TAG = 0x636868


def _swap(
    sends: Sequence[torch.Tensor], receives: Sequence[torch.Tensor], group: dist.ProcessGroup
) -> "Future[None]":
    """Send ``sends[j]`` to group rank ``j`` and fill ``receives[j]`` from it, for every other
    rank ``j`` (both contiguous); every receive is posted before the first send.

    Messages between two ranks pair up in the order they were posted, so callers issue swaps
    on a group in the same order on every rank, as they do collectives.
    """
    me, ranks = group.rank(), dist.get_process_group_ranks(group)
    peers = [j for j in range(len(ranks)) if j != me]
    works = [dist.irecv(receives[j], ranks[j], group=group, tag=_SWAP_TAG) for j in peers]
    works += [dist.isend(sends[j], ranks[j], group=group, tag=_SWAP_TAG) for j in peers]
    return _waiter(group).completion(works)


class _Waiter:
    """Waits for a group's point-to-point works on a thread of its own, completing futures.

    gloo's send and receive works have no future, only a blocking ``wait()`` (which raises
    after the group's timeout). One thread per group runs the jobs handed to it in order (a
    job waits on works, and may post more), and completes each job's future once the job has
    returned; the future's callbacks then run on that thread, as a collective's run on gloo's.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._tags = itertools.count()
        self._thread = threading.Thread(target=self._run, name="commhooks-swap", daemon=True)
        self._thread.start()

    def completion(self, works: list[Any]) -> "Future[None]":
        """A future completed once every one of ``works`` has finished (or failed)."""
        return self.run(lambda: _wait_all(works))

    def run(self, job: Callable[[], T]) -> "Future[T]":
        """A future holding what ``job`` returned once it has run on this thread (failed if it
        raised)."""
        fut: Future[T] = Future()
        self._queue.put((job, fut))
        return fut

    def new_tag(self) -> int:
        """A point-to-point tag of this group's own, different from the last 65535 given."""
        return _SWAP_TAG + 1 + next(self._tags) % 0xFFFF

    def stop(self, wait_s: float = 0.0) -> None:
        """Let the thread end once the jobs queued before have run, waiting at most ``wait_s``."""
        self._queue.put(None)
        if wait_s > 0 and self._thread is not threading.current_thread():
            self._thread.join(wait_s)

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            with _waiters_lock:
                _running.discard(self)

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            job, fut = item
            del item
            try:
                result = job()
            except BaseException as exc:  # handed to whoever waits on the future
                del job
                fail(fut, exc)
                del fut
                continue
            del job  # its tensors go before the callbacks run
            fut.set_result(result)
            # Neither waits here for the next job: the future holds its result's tensors.
            del result, fut


def _wait_all(works: list[Any]) -> None:
    for work in works:
        work.wait()


_waiters: "weakref.WeakKeyDictionary[dist.ProcessGroup, _Waiter]" = weakref.WeakKeyDictionary()
# Every waiter whose thread has not ended, its group's or not: a group that outlives
# ``dist.destroy_process_group`` (DDP keeps the default group alive) keeps its waiter in
# ``_waiters``, one that does not has had its waiter stopped, but the thread may still be
# running the last job's callbacks; either must be over before the interpreter shuts down.
_running: "set[_Waiter]" = set()
_waiters_lock = threading.Lock()
# How long interpreter exit waits for the waiters' threads in all: their jobs are done when
# training is, so this is only reached by a job stuck on a rank that has gone.
_EXIT_WAIT_S = 10.0


def _waiter(group: dist.ProcessGroup) -> _Waiter:
    with _waiters_lock:
        found = _waiters.get(group)
        if found is None:
            found = _waiters[group] = _Waiter()
            _running.add(found)
            weakref.finalize(group, found.stop).atexit = False
        return found


@atexit.register
def _stop_waiters() -> None:
    """End the waiters' threads before the interpreter shuts down: a thread still inside
    torch when it does is ended where it stands, which aborts the process."""
    with _waiters_lock:
        stopping = list(_running)  # every waiter of _waiters whose thread still runs, and more
        _waiters.clear()  # a swap after this gets a waiter of its own
    deadline = time.monotonic() + _EXIT_WAIT_S
    for found in stopping:
        found.stop(wait_s=max(deadline - time.monotonic(), 1e-3))


def _forget_waiters() -> None:
    """In a forked child the waiters' threads do not exist: start afresh."""
    global _waiters_lock
    _waiters.clear()
    _running.clear()
    _waiters_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_waiters)
