"""Finishing a bucket on the thread that issued it, rather than in a callback of the backend's.

On gloo with CPU tensors a collective's future completes on one of the backend's worker threads,
and a Python callback attached to it runs there. That thread must then take the GIL from the
thread running the backward pass (which holds it while DDP calls a hook), once a bucket, and
each torch call the callback makes hands the GIL back and forth again. On one rank with 96
small buckets that exchange cost more than a hook's own work: PyTorch's fp16 hook, one callback
a bucket, spent 148-174 us a bucket; the same work finished by the issuing thread, 54-93 us.

A :class:`PollQueue` holds what is to run once a future completes, oldest first; the hook's
thread polls (:func:`commhooks.comm.poll`) after it has issued each bucket, which runs whatever
has completed by then, and waits for the rest at the step's last bucket (or where its caller
waits for each result, inside :func:`commhooks.comm.unheld_follow_ups`). Hooks do this for
DDP's own buckets only: DDP reads no bucket's result before the last bucket's hook has
returned, so nothing is finished later than DDP looks.

Never used where collectives complete as they are queued (NCCL): there a callback runs at
once on the issuing thread, which is what this arranges.
"""

import collections
import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["PollQueue"]

Future = torch.futures.Future


class PollQueue:
    """Functions waiting for futures, run by whoever polls, in the order they were added.

    Safe to poll from several threads: each function runs once, after every one added before
    it, with the queue's lock held (functions must not add to or poll their own queue).
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._queue: collections.deque[tuple[Future[Any], Callable[[Future[Any]], None]]] = (
            collections.deque()
        )

    def add(self, after: "Future[Any]", run: Callable[["Future[Any]"], None]) -> None:
        """Run ``run(after)`` at a poll once ``after`` has completed (with a result or an
        error, which ``run`` reads from it)."""
        with self._lock:
            self._queue.append((after, run))

    def poll(self, wait: bool = False) -> None:
        """Run, oldest first, the functions whose futures have completed, up to the first one
        still pending; with ``wait``, every one, waiting for each future in turn (without the
        lock, so that the backend's threads are never held up by it)."""
        while True:
            with self._lock:
                if not self._queue:
                    return
                first = self._queue[0]
                if first[0].done():
                    self._queue.popleft()
                    first[1](first[0])
                    continue
            if not wait:
                return
            _settled(first[0])

    def __len__(self) -> int:
        with self._lock:
            return len(self._queue)


def _settled(fut: "Future[Any]") -> None:
    """Wait until ``fut`` has completed, successfully or not: its error is for its function
    to read, not for the poller to raise."""
    with contextlib.suppress(Exception):
        fut.wait()
