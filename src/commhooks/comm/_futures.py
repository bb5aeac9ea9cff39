"""Completing torch futures by hand: shared by :mod:`commhooks.comm` and its gloo exchanges."""

from typing import Any, cast

import torch

__all__ = ["fail"]


def fail(fut: "torch.futures.Future[Any]", exc: BaseException) -> None:
    """Complete ``fut`` with the error ``exc``, which whoever waits on it receives."""
    # torch's stub types the argument of set_exception as the result type; it takes any error.
    fut.set_exception(cast(Any, exc))
