"""A family of fused kernels, loaded on first use, that callers can turn off for a while.

The CPU and Triton kernels are optional: where they do not load, callers run PyTorch's eager
operations, with the same bits. Tests compare the two forms by turning the kernels off in the
whole process (a hook's later phases run on the backend's threads): :meth:`KernelLoader.disabled`.
"""

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["KernelLoader"]

T = TypeVar("T")


class KernelLoader(Generic[T]):
    """What ``load`` returns (``None``: the kernels are not there), loaded once, on first use."""

    def __init__(self, load: Callable[[], T | None]) -> None:
        self._load = load
        self._lock = threading.Lock()
        self._loaded: list[T | None] = []  # empty until loaded
        # How many disabled() blocks are active, in any thread: a plain attribute, which a call
        # bound to loaded kernels reads instead of calling get() (a frame a kernel call).
        self.off = 0

    def get(self) -> T | None:
        """The kernels, loading them on the first call; ``None`` while disabled or missing."""
        loaded = self._loaded
        if loaded and not self.off:  # once loaded, read without the lock (a call a kernel)
            return loaded[0]
        with self._lock:
            if self.off:
                return None
            if not self._loaded:
                self._loaded.append(self._load())
            return self._loaded[0]

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Callers run the eager form, in every thread, while the block is active."""
        with self._lock:
            self.off += 1
        try:
            yield
        finally:
            with self._lock:
                self.off -= 1
