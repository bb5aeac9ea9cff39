"""Python callbacks on torch futures, and an interpreter exit that waits until they are let go.

A gloo worker thread that completes a future runs its Python callbacks, then drops them, then
drops the collective itself (with its tensors); dropping a Python function, or a tensor whose
Python object outlived Python's own references, needs the GIL. When a training script simply
ends, the main thread may already be shutting the interpreter down at that moment; Python then
ends the worker thread where it stands and the C++ runtime aborts the whole process ("terminate
called without an active exception", exit code -6) after training has finished. It happens on
the last step, more often on a loaded machine, with PyTorch's own hooks too, and
``dist.destroy_process_group()`` does not prevent it while a model or a hook state still holds
the group.

So every callback this package hands to a future goes through :func:`then` or
:func:`when_done`, which wrap it in a function of its own whose release can be observed. At
exit, before the interpreter starts shutting down, a process that handed out callbacks waits
without the GIL (so the worker threads can take it) until the callbacks of every completed
future have been released, at most :data:`EXIT_WAIT_S`, then :data:`GRACE_S` more for the
collectives dropped right after them. Callbacks of futures that never completed are not waited
for: no thread is about to release them.
"""

import atexit
import itertools
import os
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["EXIT_WAIT_S", "GRACE_S", "held", "then", "when_done"]

S = TypeVar("S")
T = TypeVar("T")
Future = torch.futures.Future

EXIT_WAIT_S = 2.0
"""The longest the interpreter's exit waits for worker threads to release callbacks."""

GRACE_S = 0.05
"""How long the GIL stays free at exit after the last callback was released."""


def then(fut: "Future[S]", fn: Callable[["Future[S]"], T]) -> "Future[T]":
    """``fut.then(fn)``, with ``fn``'s release awaited at interpreter exit."""

    def call(done: "Future[S]") -> T:
        return fn(done)

    _registry.track(call, fut)
    return fut.then(call)


def when_done(fut: "Future[S]", fn: Callable[["Future[S]"], None]) -> None:
    """``fut.add_done_callback(fn)``, with ``fn``'s release awaited at interpreter exit."""

    def call(done: "Future[S]") -> None:
        fn(done)

    _registry.track(call, fut)
    fut.add_done_callback(call)


def held() -> int:
    """Callbacks handed to futures and not released yet (completed futures' and pending)."""
    return len(_registry.entries)


class _Registry:
    """The callbacks handed out and not released yet, each with the future it waits on.

    An entry leaves when its callback is released, on whichever thread releases it: plain dict
    operations are atomic under the GIL, so no lock is needed (and none could be taken in a
    weakref callback, which may run inside any allocation).
    """

    def __init__(self) -> None:
        self.entries: dict[int, tuple[weakref.ref[Callable[..., Any]], Future[Any]]] = {}
        self.keys = itertools.count()
        self.used = False

    def track(self, call: Callable[..., Any], fut: "Future[Any]") -> None:
        self.used = True
        key = next(self.keys)
        self.entries[key] = (weakref.ref(call, lambda _: self.entries.pop(key, None)), fut)

    def releasing(self) -> bool:
        """Whether a completed future's callback is still held: a thread is about to drop it."""
        return any(fut.done() for _, fut in list(self.entries.values()))

    def wait(self, limit_s: float = EXIT_WAIT_S) -> None:
        if not self.used:
            return
        deadline = time.monotonic() + limit_s
        while self.releasing() and time.monotonic() < deadline:
            time.sleep(0.001)  # sleeping releases the GIL, which the worker thread needs
        time.sleep(GRACE_S)

    def forget(self) -> None:
        """In a forked child: the parent's worker threads are not here to release anything."""
        self.entries.clear()
        self.used = False


_registry = _Registry()
atexit.register(_registry.wait)
os.register_at_fork(after_in_child=_registry.forget)
