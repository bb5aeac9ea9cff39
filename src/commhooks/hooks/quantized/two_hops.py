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

import itertools
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
        """The parts of the parameters' gradients the share holds, in the order of their numbers."""
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
    is what the machine reduce-scatters and gathers into, the bucket's gradients laid out by
    their stable numbers (the buffer itself where DDP's order is that one, as after its rebuild;
    else a copy, padded to whole shares), and ``chunk`` this rank's share of it, of which
    ``valid`` elements are the bucket's.

    Laid out by number, a bucket of the same parameters is cut into the same shares whatever
    order DDP hands them in (a fresh DDP's first step, after a restart, lists them backwards),
    so each share's memories meet the same parts of parameters and a restart resumes bit for
    bit, as on the flat path.
    """

    def __init__(
        self, bucket: GradBucket, buffer: torch.Tensor, hops: comm.TwoHops, numbers: tuple[int, ...]
    ) -> None:
        numel, ranks = buffer.numel(), hops.nproc_per_node
        size = -(-numel // ranks)
        self.signature = _signature(bucket, buffer)
        grads, params = _by_number(bucket.gradients(), bucket.parameters(), numbers)
        sources = [int(g.storage_offset() - buffer.storage_offset()) for g in grads]
        targets = list(itertools.accumulate((g.numel() for g in grads[:-1]), initial=0))
        in_order = sources == targets
        whole = buffer if in_order and size * ranks == numel else buffer.new_zeros(size * ranks)
        self.whole = whole
        # Views of the buffer and of ``whole`` holding each gradient, where the orders differ.
        moved = [] if in_order else list(zip(grads, sources, targets))
        self._in_buffer = [buffer[a : a + g.numel()] for g, a, _ in moved]
        self._in_whole = [whole[b : b + g.numel()] for g, _, b in moved]
        self.chunk = buffer.new_zeros(size)
        start = hops.local * size
        self.valid = max(0, min(numel, start + size) - start)
        gradients, held, parts = _parts(grads, params, targets, self.chunk, start, self.valid)
        self.bucket = ShareBucket(bucket.index(), self.chunk[: self.valid], gradients, held, parts)
        self.work: Workspace | None = None  # the cross-machine step's, set in its turn

    @staticmethod
    def of(
        state: QuantizationState, bucket: GradBucket, buffer: torch.Tensor, numbers: tuple[int, ...]
    ) -> "Share":
        """The share of ``bucket`` its last step used, or a new one (where the bucket holds
        other parameters, the memories of those it holds no part of are dropped: they were
        another cut's)."""
        assert state.hops is not None, "a two-hop state"
        found = state.shares.get(bucket.index())
        if not isinstance(found, Share) or found.signature != _signature(bucket, buffer):
            last = found.signature[2] if isinstance(found, Share) else None
            found = state.shares[bucket.index()] = Share(bucket, buffer, state.hops, numbers)
            if found.signature[2] != last:  # not only a new buffer
                state.forget_parts_of(set(numbers) - set(state.number(found.bucket.parameters())))
        return found

    def fill(self, buffer: torch.Tensor) -> None:
        """Put the bucket's gradients into ``whole``, where it is not the buffer."""
        if self._in_whole:
            torch._foreach_copy_(self._in_whole, self._in_buffer)
        elif self.whole is not buffer:
            self.whole[: buffer.numel()].copy_(buffer)

    def finish(self, buffer: torch.Tensor) -> torch.Tensor:
        """The bucket, holding the average (copied back from ``whole`` where it is a copy)."""
        if self._in_buffer:
            torch._foreach_copy_(self._in_buffer, self._in_whole)
        elif self.whole is not buffer:
            buffer.copy_(self.whole[: buffer.numel()])
        return buffer


def _signature(bucket: GradBucket, buffer: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
    return buffer.data_ptr(), buffer.numel(), tuple(map(id, bucket.parameters()))


def _by_number(
    grads: list[torch.Tensor], params: list[Any], numbers: tuple[int, ...]
) -> tuple[list[torch.Tensor], list[Any]]:
    """The bucket's gradients and parameters in the order of their stable numbers."""
    order = sorted(range(len(grads)), key=numbers.__getitem__)
    return [grads[i] for i in order], [params[i] for i in order]


def _parts(
    grads: list[torch.Tensor],
    params: list[Any],
    targets: list[int],
    chunk: torch.Tensor,
    start: int,
    valid: int,
) -> tuple[list[torch.Tensor], list[Any], list[tuple[int, int] | None]]:
    """The views of ``chunk`` standing for the parts of the gradients that lie, at ``targets``,
    in elements ``[start, start + valid)`` of the share's layout, their parameters, and which
    elements of each parameter they are (``None``: all)."""
    gradients, held, parts = [], [], []
    for grad, param, first in zip(grads, params, targets):
        numel = grad.numel()
        low, high = max(first, start), min(first + numel, start + valid)
        if low < high:
            gradients.append(chunk[low - start : high - start])
            held.append(param)
            whole = high - low == numel
            parts.append(None if whole else (low - first, high - first))
    return gradients, held, parts


def average_two_hops(
    state: QuantizationState, bucket: GradBucket, buffer: torch.Tensor, group: dist.ProcessGroup
) -> "Future[torch.Tensor]":
    """The hook's step on the two-hop path: the reduce-scatter issued here, on DDP's thread; the
    quantized phases across machines and the all-gather within in the issuers' turns, each
    group's in bucket order (so a bucket's exchange across need not wait for an earlier
    bucket's all-gathers)."""
    hops, issuers = state.hops, state.hop_issuers
    assert hops is not None and issuers is not None, "prepare() made them"
    numbers = state.number(bucket.parameters())  # on DDP's thread, from the first step
    if not state.compressing(bucket.is_last()) or buffer.numel() == 0:
        return comm.average(buffer, group)
    share = Share.of(state, bucket, buffer, numbers)
    share.fill(buffer)
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
