"""The library's warning category, and warnings worth saying once per process, not once per
bucket per step."""

import threading
import warnings

__all__ = ["CommHooksWarning", "warn_once"]

_seen: set[str] = set()
_lock = threading.Lock()


class CommHooksWarning(UserWarning, RuntimeWarning):
    """What commhooks warns about: a fallback taken, a value clipped, an option restored.

    A ``UserWarning`` (advice to act on) and a ``RuntimeWarning`` (about values met at run
    time), so filters on either category see it; filter on this one to target commhooks alone.
    """


def warn_once(key: str, message: str, category: type[Warning] = CommHooksWarning) -> None:
    """Emit ``message`` the first time ``key`` is seen in this process."""
    with _lock:
        if key in _seen:
            return
        _seen.add(key)
    warnings.warn(message, category, stacklevel=3)
