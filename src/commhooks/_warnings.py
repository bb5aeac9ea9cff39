"""Warnings that are worth saying once per process, not once per bucket per step."""

import threading
import warnings

_seen: set[str] = set()
_lock = threading.Lock()


def warn_once(key: str, message: str, category: type[Warning] = RuntimeWarning) -> None:
    """Emit ``message`` the first time ``key`` is seen in this process."""
    with _lock:
        if key in _seen:
            return
        _seen.add(key)
    warnings.warn(message, category, stacklevel=3)
