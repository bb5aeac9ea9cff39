"""Completing torch futures by hand: shared by :mod:`commhooks.comm` and its gloo exchanges."""

from typing import Any, cast

import torch

__all__ = ["checked", "fail"]


def fail(fut: "torch.futures.Future[Any]", exc: BaseException) -> None:
    """Complete ``fut`` with the error ``exc``, which whoever waits on it receives."""
    # torch's stub types the argument of set_exception as the result type; it takes any error.
    fut.set_exception(cast(Any, exc))


def checked(fut: "torch.futures.Future[Any]", out: torch.Tensor) -> torch.Tensor:
    """``out``, once ``fut``'s collective has completed: a callback's body. A failure is raised
    here, in the callback, rather than set on the future handed on, so that the backend's
    error reaches DDP as it is."""
    fut.value()  # raises here if the collective failed
    return out
