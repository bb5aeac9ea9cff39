"""Option checks shared by the stateful objects, raising ``ValueError`` that names the fix."""

from typing import Any

__all__ = ["check_bool", "check_int"]


def check_int(owner: str, name: str, value: Any, minimum: int, hint: str = "") -> int:
    """Return ``value`` if it is an integer ``>= minimum``; otherwise say what to pass."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{owner}: {name} must be an integer, got {value!r}.{hint}")
    if value < minimum:
        raise ValueError(f"{owner}: {name} must be >= {minimum}, got {value}.{hint}")
    return value


def check_bool(owner: str, name: str, value: Any) -> bool:
    """Return ``value`` if it is a ``bool`` (not merely truthy: ``"False"`` is a common slip)."""
    if not isinstance(value, bool):
        raise ValueError(f"{owner}: {name} must be True or False, got {value!r}.")
    return value
