"""Gradient shards whose averaging finishes when the backward pass ends, overlapping the rest of it.

FSDP2 calls the all-reduce hook once per module during the backward pass. In the common case it
then only makes the module's gradients views of the shard (see
``_fsdp_layout.shard_becomes_gradients``), so the hook need not wait for its collectives: the
result has to be in the shard when the optimizer reads the gradients, not before. Waiting for
each module in turn would leave the link idle while the next module's gradients are computed,
and the computation idle while the link works, which is what DDP's buckets avoid.

:class:`PendingShards` keeps each module's averaging and finishes them all in a callback that
autograd runs at the end of the backward pass, before ``backward()`` returns (where DDP and
FSDP2 finish their own communication).

Hook-facing modules must not use ``from __future__ import annotations``.
"""

import threading

import torch
from torch.autograd import Variable

__all__ = ["PendingShards"]


class PendingShards:
    """The averagings of one model's gradient shards still running in this backward pass.

    Every hook of a model shares one. A backward pass that fails before its end leaves its
    entries behind; the next pass's callback finishes them too (they hold the dead pass's
    shards, which nobody reads any more).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: list[tuple[torch.Tensor, torch.futures.Future[torch.Tensor]]] = []

    def add(self, shard: torch.Tensor, averaging: "torch.futures.Future[torch.Tensor]") -> bool:
        """Finish ``averaging`` into ``shard`` at the end of the running backward pass.

        Returns:
            False, keeping nothing, when no backward pass is running on this thread (the
            caller must then wait for the result itself).
        """
        try:
            Variable._execution_engine.queue_callback(self.finish)
        except RuntimeError:  # "can only be installed during backward pass"
            return False
        with self._lock:
            self._entries.append((shard, averaging))
        return True

    def finish(self) -> None:
        """Wait for every averaging added so far and leave each result in its shard.

        Raises:
            RuntimeError: a hook returned a result of another size than its shard; or what
                an averaging raised (a timeout, a peer that left), out of ``backward()``.
        """
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
