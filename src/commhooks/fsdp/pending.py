"""Gradient shards whose averaging finishes when the backward pass ends, overlapping the rest of it.

Where FSDP2 only makes a module's gradients views of its shard
(:func:`~.layout.shard_becomes_gradients`), the result must be in the shard when the optimizer
reads it, not before: waiting for each module in turn would leave the link idle while the next
module's gradients are computed, and the other way round. :class:`PendingShards` finishes every
module's averaging in a callback autograd runs before ``backward()`` returns (where DDP and
FSDP2 finish their own communication).

Hook-facing modules must not use ``from __future__ import annotations``.
"""

import threading

import torch
from torch.autograd import Variable

__all__ = ["PendingShards"]


class PendingShards:
    """The averagings of one model's gradient shards still running in this backward pass
    (those a failed pass left behind are finished by the next's callback)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: list[tuple[torch.Tensor, torch.futures.Future[torch.Tensor]]] = []

    def add(self, shard: torch.Tensor, averaging: "torch.futures.Future[torch.Tensor]") -> bool:
        """Finish ``averaging`` into ``shard`` at the end of the running backward pass;
        ``False``, keeping nothing, where none runs on this thread (then wait for it)."""
        try:
            Variable._execution_engine.queue_callback(self.finish)
        except RuntimeError:  # "can only be installed during backward pass"
            return False
        with self._lock:
            self._entries.append((shard, averaging))
        return True

    def finish(self) -> None:
        """Wait for every averaging added so far and leave each result in its shard; what an
        averaging raised comes out of ``backward()``."""
        with self._lock:
            entries, self._entries = self._entries, []
        for shard, averaging in entries:
            place(shard, averaging.wait())


def place(shard: torch.Tensor, averaged: torch.Tensor) -> None:
    """Leave a hook's result in the shard FSDP2 gave it (a copy only if it is another tensor)."""
    if averaged is shard:
        return
    if averaged.numel() != shard.numel():
        raise RuntimeError(
            f"commhooks.fsdp: the hook returned {averaged.numel()} elements for a shard "
            f"of {shard.numel()}; a hook must return a tensor of its bucket's size."
        )
    shard.copy_(averaged.view_as(shard))
