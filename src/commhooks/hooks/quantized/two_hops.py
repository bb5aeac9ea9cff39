"""Two hops: sum within each machine at full precision, average each machine's share across
machines in 8 or 4 bits, gather within the machine (the scheme of ZeRO++'s qgZ).

The flat average sends every rank's quantized bucket across machines, G times a machine of G
ranks. Here a machine first reduce-scatters the bucket at full precision (rank ``l`` holds the
machine's mean of share ``l``), the ranks holding share ``l`` on every machine average it with
the quantized phases and their error feedback, and an all-gather inside the machine hands every
rank the whole bucket: G times fewer bytes across, the same bits on every rank.

The share is a bucket of its own (:class:`ShareBucket`), whose gradients are the parts of the
bucket's parameters it holds, so the memories are kept per parameter as on the flat path. The
exchanges after the reduce-scatter are follow-ups, each group's in its issuer's order.

Hook modules must not use ``from __future__ import annotations``: DDP rejects string annotations.
"""

from typing import Any

import torch
import torch.distributed as dist

from commhooks import comm
from commhooks.hooks._bucket import GradBucket
from commhooks.hooks.quantized import phases
from commhooks.hooks.quantized.layout import Workspace
from commhooks.hooks.quantized.state import QuantizationState

__all__ = ["Share", "ShareBucket", "average_two_hops"]

Future = torch.futures.Future


class ShareBucket:
    """This rank's share of a bucket, seen through a bucket's methods."""

    def __init__(
        self,
        index: int,
        buffer: torch.Tensor,
        gradients: list[torch.Tensor],
        params: list[Any],
        parts: list[tuple[int, int] | None],
    ) -> None:
        self._index, self._buffer = index, buffer
        self._gradients, self._params, self._parts = gradients, params, parts

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        """The share's elements of the bucket: the machine's mean, then its average."""
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """The parts of the parameters' gradients the share holds, in the bucket's order."""
        return self._gradients

    def parameters(self) -> list[Any]:
        return self._params

    def parts(self) -> list[tuple[int, int] | None]:
        """Which elements of its parameter each gradient holds, ``(first, stop)``; ``None``
        for a whole one. The memories are kept by them: another cut of the bucket (DDP's
        rebuild, a restart) gives another part, whose memory must not be taken for this one's.
        """
        return self._parts

    def is_last(self) -> bool:
        return False  # the step is counted on the bucket itself

    def set_buffer(self, buffer: torch.Tensor) -> None:
        raise NotImplementedError("a share's buffer is its own")


class Share:
    """One rank's share of a bucket, kept while the bucket's buffer and parameters stay: ``whole``
    is what the machine reduce-scatters and gathers into (the buffer, or a padded copy), and
    ``chunk`` this rank's share of it, of which ``valid`` elements are the bucket's."""

    def __init__(self, bucket: GradBucket, buffer: torch.Tensor, hops: comm.TwoHops) -> None:
        numel, ranks = buffer.numel(), hops.nproc_per_node
        size = -(-numel // ranks)
        self.signature = _signature(bucket, buffer)
        self.whole = buffer if size * ranks == numel else buffer.new_zeros(size * ranks)
        self.chunk = buffer.new_zeros(size)
        start = hops.local * size
        self.valid = max(0, min(numel, start + size) - start)
        gradients, params, parts = _parts(bucket, buffer, self.chunk, start, self.valid)
        self.bucket = ShareBucket(
            bucket.index(), self.chunk[: self.valid], gradients, params, parts
        )
        self.work: Workspace | None = None  # the cross-machine step's, set in its turn

    @staticmethod
    def of(state: QuantizationState, bucket: GradBucket, buffer: torch.Tensor) -> "Share":
        """The share of ``bucket`` its last step used, or a new one."""
        assert state.hops is not None, "a two-hop state"
        found = state.shares.get(bucket.index())
        if not isinstance(found, Share) or found.signature != _signature(bucket, buffer):
            found = state.shares[bucket.index()] = Share(bucket, buffer, state.hops)
        return found

    def finish(self, buffer: torch.Tensor) -> torch.Tensor:
        """The bucket, holding the average (copied from the padded copy where there is one)."""
        if self.whole is not buffer:
            buffer.copy_(self.whole[: buffer.numel()])
        return buffer


def _signature(bucket: GradBucket, buffer: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
    return buffer.data_ptr(), buffer.numel(), tuple(map(id, bucket.parameters()))


def _parts(
    bucket: GradBucket, buffer: torch.Tensor, chunk: torch.Tensor, start: int, valid: int
) -> tuple[list[torch.Tensor], list[Any], list[tuple[int, int] | None]]:
    """The views of ``chunk`` standing for the parts of the bucket's gradients in elements
    ``[start, start + valid)`` of its buffer, their parameters, and which elements of each
    parameter they are (``None``: all)."""
    gradients, params, parts = [], [], []
    base = buffer.storage_offset()
    for grad, param in zip(bucket.gradients(), bucket.parameters()):
        first, numel = int(grad.storage_offset() - base), grad.numel()
        low, high = max(first, start), min(first + numel, start + valid)
        if low < high:
            gradients.append(chunk[low - start : high - start])
            params.append(param)
            whole = high - low == numel
            parts.append(None if whole else (low - first, high - first))
    return gradients, params, parts


def average_two_hops(
    state: QuantizationState, bucket: GradBucket, buffer: torch.Tensor, group: dist.ProcessGroup
) -> "Future[torch.Tensor]":
    """The hook's step on the two-hop path: the reduce-scatter issued here, on DDP's thread; the
    quantized phases across machines and the all-gather within in the issuers' turns, each
    group's in bucket order (so a bucket's exchange across need not wait for an earlier
    bucket's all-gathers)."""
    hops, issuers = state.hops, state.hop_issuers
    assert hops is not None and issuers is not None, "prepare() made them"
    state.number(bucket.parameters())  # on DDP's thread, from the first step, as on the flat path
    if not state.compressing(bucket.is_last()) or buffer.numel() == 0:
        return comm.average(buffer, group)
    share = Share.of(state, bucket, buffer)
    if share.whole is not buffer:
        share.whole[: buffer.numel()].copy_(buffer)
    summed = comm.reduce_scatter(share.chunk, share.whole, hops.intra)
    devices = comm.future_devices(buffer)
    if share.valid:
        exchanged = issuers.across.then(summed, lambda _: _across(state, share, hops), devices)
        gathered = issuers.gather.then(
            exchanged, lambda _: _second_phase(state, share, hops), devices
        )
        averaged = issuers.within.then(gathered, lambda _: _within(state, share, hops), devices)
    else:  # shares of padding only, on every machine alike: nothing crosses
        averaged = issuers.within.then(summed, lambda _: _gather(share, hops), devices)
    return comm.then(averaged, lambda fut: _finished(fut, share, buffer))


def _across(state: QuantizationState, share: Share, hops: comm.TwoHops) -> "Future[Any]":
    """Across machines, phase 1: the machine's mean of the share compensated and quantized,
    one row a machine, and the all-to-all over the peers."""
    share.chunk.div_(hops.nproc_per_node)  # the machine's sum, made its mean
    work = share.work = state.workspace(share.bucket, share.bucket.buffer())
    phases.quantize_rows(state, work)
    return phases.exchange_rows(work, hops.peers)


def _second_phase(state: QuantizationState, share: Share, hops: comm.TwoHops) -> "Future[Any]":
    assert share.work is not None, "the first phase set it"
    return phases.reduce_and_gather(state, share.work, hops.peers_follow)


def _within(state: QuantizationState, share: Share, hops: comm.TwoHops) -> "Future[torch.Tensor]":
    """In its turn, the all-gather across machines complete: the share's average decoded and
    the memories kept; then the all-gather within."""
    assert share.work is not None, "the first phase set it"
    phases.decode_and_commit(state, share.work, share.bucket.buffer())
    return _gather(share, hops)


def _gather(share: Share, hops: comm.TwoHops) -> "Future[torch.Tensor]":
    whole = share.whole.view(hops.nproc_per_node, -1)
    return comm.all_gather_into(whole, share.chunk, hops.intra_follow)


def _finished(fut: "Future[torch.Tensor]", share: Share, buffer: torch.Tensor) -> torch.Tensor:
    fut.wait()  # raises if an exchange failed
    return share.finish(buffer)
