"""Quantized averaging with error feedback: 8 or 4 bits per element on the wire, any backend.

Per bucket, in two phases (the scheme of ZeRO++'s qgZ and torchft's quantized allreduce):

1. Each rank adds its remembered error to its gradient, cuts the zero-padded result into one
   row per rank, quantizes it in blocks with a scale each (:mod:`commhooks.compress.blocks`),
   and keeps what was dropped as its next error. An all-to-all hands each rank every rank's copy
   of the row it owns.
2. The owner decodes and sums those copies in float32, divides by the world size, adds the
   error it remembers for that row, quantizes the average again (keeping that error too), and
   an all-gather hands everyone every row. Every rank decodes the same bytes, so the result is
   the same on every rank, bit for bit.

A block holding inf or NaN gives the gathered result a scale that is not finite; deciding that
reads a check back to the host, which on a GPU waits for the device, so it is read once a
step, not once a bucket. Where collectives complete as they are queued (NCCL's), the bucket
is filed in its issuer's held sums (:mod:`commhooks.hooks._held_sums`) and decided at the
step's last bucket with the others: one batched check of every bucket's gathered scales, then
each finite bucket decoded in turn. Where they complete later (gloo with CUDA tensors), the
check is held with the step's others (:func:`commhooks.finiteness.held_for`) and answered
together at the first decision, which is held until the step's last bucket
(:func:`commhooks.comm.holds_follow_ups`).

Each rank sends ``2 (p - 1) / p`` of the bucket at ``bits`` per element plus a float32 scale
per block: with the default 256-element blocks, 0.254 (int8) or 0.129 (int4) of what a
float32 ring allreduce sends, at any world size; 0.121 with ``packed`` 4-bit codes, 13 levels
eight to 30 bits (:mod:`commhooks.compress.packing`), packed before each exchange and
unpacked after it.

Hook modules must not use ``from __future__ import annotations``: DDP rejects string annotations.
"""

from collections.abc import Callable
from typing import Any

import torch

from commhooks import comm, finiteness
from commhooks._warnings import warn_once
from commhooks.compress import blocks, packing
from commhooks.hooks._bucket import GradBucket, float_buffer
from commhooks.hooks._held_sums import held_sums
from commhooks.hooks.quantized.state import (
    HOOK,
    QuantizationOptions,
    QuantizationState,
    Wire,
    Workspace,
)

__all__ = ["QuantizationOptions", "QuantizationState", "quantized_hook"]

_HOOK = HOOK


def quantized_hook(
    state: QuantizationState,
    bucket: GradBucket,
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with 8- or 4-bit blocks on the wire, remembering what was dropped.

    Plain allreduce for the first ``state.warmup_steps`` steps. Then the two phases of the
    module docstring: an all-to-all issued here, on DDP's thread, and an all-gather started
    when it completes, through the state's ordered issuer, so that many buckets issue their
    collectives in the same order on every rank (where collectives complete as they are
    queued, as NCCL's do, at once, here). A group of one rank sends nothing: its packets are
    what the collectives would hand back, and the same passes run on them.

    Accuracy: with nearest rounding, each element of the result is within
    ``(mean over ranks of a1 + a2) / (2 qmax)`` of the exact average of the compensated
    gradients (plus float32 rounding), where ``a1`` is the absolute maximum of the element's
    block of a rank's compensated gradient, ``a2`` that of its block of the average, and
    ``qmax`` is 127 (int8) or 7 (int4); in particular within ``max|g| / qmax`` over the bucket.
    With error feedback, nothing is lost over steps: what a step applies plus the new memories
    (the ranks' mean first memory plus the owners' second) equals the exact average plus the
    previous memories.

    Non-finite gradients: a block holding inf or NaN makes a scale of the gathered result
    non-finite, which every rank sees alike; all ranks then send the bucket again with plain
    allreduce, so inf and NaN land where plain allreduce puts them, and the step leaves both
    memories as they were.

    Args:
        state: the :class:`QuantizationState` with the options and memories.
        bucket: the gradient bucket DDP hands to the hook (or anything with its methods).
    """
    if type(state) is not QuantizationState:  # (the exact type: no isinstance a bucket)
        state = _check_state(state)
    buffer = float_buffer(bucket, _HOOK)
    group = state.prepare()
    last = bucket.is_last()
    work = state.begin(bucket, buffer, last)
    devices = comm.future_devices(buffer)
    queued = comm.holds_follow_ups(devices)  # the checks' reads wait for a later bucket
    hold = queued and not last  # (comm.follow_up_options, without asking twice)
    if work is None:
        return comm.average(buffer, group) if buffer.numel() else comm.completed(buffer)
    settings = state.settings
    bound = work.now.quantize  # a CPU's call bound to these buffers, tried first (none on a GPU)
    if bound is None or settings.rounding != blocks.NEAREST or not bound(work.addition):
        blocks.quantize_(
            work.rows, work.send, work.fmt, work.levels, rounding=settings.rounding,
            generator=work.first, keep_error=settings.error_feedback, add=work.addition,
        )  # fmt: skip
    issuer = state.issuer
    assert issuer is not None, "prepare() made the issuer"
    if work.alone:  # nothing travels: the packets are what the exchanges would hand back
        _reduce(state, work)
        if queued:  # a GPU's: decided with the step's other buckets, at its last
            return _held_decision(state, work, buffer, None, last)
        return _as_future(_decode_or_resend(state, work, buffer))
    # Where collectives complete as they are queued (NCCL's), comm gives follow-ups the hook's
    # own group: the all-to-all is complete when issued, and the owner's pass and the
    # all-gather follow at once, on DDP's thread, in bucket order.
    inline = issuer.group is group
    if inline and queued:  # a GPU's: decided with the step's other buckets, at its last
        _exchange_rows(work, work.fmt, group, comm.issue_all_to_all).wait()
        gathered = _reduce_and_gather(state, work, comm.issue_all_gather)
        return _held_decision(state, work, buffer, gathered, last)
    exchanged = _exchange_rows(work, work.fmt, group, comm.all_to_all)

    # Both phases touch the state's memories: where they wait for their turns, one at a time.
    def share(_: object = None) -> torch.futures.Future[torch.Tensor]:
        return _reduce_and_share(state, work, queued)

    def decide() -> "torch.futures.Future[torch.Tensor] | comm.Finished[torch.Tensor]":
        return _decode_or_resend(state, work, buffer)

    if inline:  # only the decision, which reads the check, waits for its turn
        exchanged.wait()  # the current stream waits for the all-to-all's
        gathered = share()
    else:
        gathered = issuer.then(exchanged, share, devices, hold)
    return issuer.rounds(gathered, (lambda _: comm.Issue(decide),), devices, hold)


def _as_future(
    done: "torch.futures.Future[torch.Tensor] | comm.Finished[torch.Tensor]",
) -> torch.futures.Future[torch.Tensor]:
    return comm.completed(done.value) if isinstance(done, comm.Finished) else done


def _check_state(state: Any) -> QuantizationState:
    if not isinstance(state, QuantizationState):
        raise TypeError(
            f"{_HOOK} needs a commhooks.QuantizationState as its state, got "
            f"{type(state).__name__}. Register it as "
            f"ddp_model.register_comm_hook(QuantizationState(None, bits=8), {_HOOK})."
        )
    return state


# An exchange of :mod:`commhooks.comm`: ``(out, tensor, group)``, complete when its future is.
Exchange = Callable[[torch.Tensor, torch.Tensor, Any], torch.futures.Future[Any]]


def _exchange_rows(
    work: Workspace, fmt: blocks.BlockFormat, group: Any, exchange: Exchange
) -> torch.futures.Future[Any]:
    """Phase 1's exchange, the all-to-all (the packets packed first, for a packed format)."""
    wire = work.wire
    if wire is None:  # the packets travel as they are
        return exchange(work.received, work.send, group)
    packing.to_wire_(work.send, fmt, work.layout.length, wire.send)
    return exchange(wire.received, wire.send, group)


def _all_gather_wired(
    state: QuantizationState, work: Workspace, wire: Wire, group: Any, gather: Exchange
) -> torch.futures.Future[Any]:
    """Phase 2's exchange for a packed format: the rows the all-to-all brought unpacked
    before the owner's pass, this rank's packet packed after it (its gathered rows are
    unpacked by :func:`_unwire_gathered` once the all-gather completes)."""
    fmt, length = work.fmt, work.layout.length
    packing.from_wire_(wire.received, fmt, length, work.received)
    _reduce(state, work)
    packing.to_wire_(work.own_packet, fmt, length, wire.own)
    return gather(wire.gathered, wire.own, group)


def _unwire_gathered(state: QuantizationState, work: Workspace) -> None:
    """Unpack the gathered rows, for a packed format (nothing to do for another)."""
    if work.wire is not None:
        fmt, length = work.fmt, work.layout.length
        packing.from_wire_(work.wire.gathered, fmt, length, work.gathered)


def _unwired(
    fut: torch.futures.Future[torch.Tensor], state: QuantizationState, work: Workspace
) -> torch.Tensor:
    """The gathered rows, unpacked (raises if the all-gather failed)."""
    fut.value()
    _unwire_gathered(state, work)
    return work.gathered


def _reduce(state: QuantizationState, work: Workspace) -> None:
    """The owner's pass: average this rank's row, add its remembered error and quantize it
    again, in one pass where a kernel takes it."""
    settings, memory = state.settings, state.owner_memory(work)
    blocks.requantize_sum_(
        work.received, work.fmt, work.now.mine, work.own_packet, work.levels, work.world,
        memory=memory, rounding=settings.rounding, generator=work.second,
        keep_error=settings.error_feedback, kernels=work.now.owner,
    )  # fmt: skip


def _reduce_and_share(
    state: QuantizationState, work: Workspace, queued: bool
) -> torch.futures.Future[torch.Tensor]:
    """Phase 2: the owner's pass (:func:`_reduce`), then the all-gather on the issuer's group;
    where the follow-ups are held (on a GPU), the check of the gathered scales is held with
    the step's others, answered together at the first decision."""
    wire, gathered = work.wire, _reduce_and_gather(state, work)
    if not queued:
        if wire is None:
            return gathered
        return comm.then(gathered, lambda fut: _unwired(fut, state, work))
    if not gathered.done():
        return comm.then(gathered, lambda fut: _held_after(fut, state, work))
    # Complete as it was issued (NCCL's): held now, without a callback and a future of its own;
    # a failed all-gather is passed on by the issuer's rounds.
    try:
        gathered.value()
    except BaseException:
        return gathered
    if wire is not None:
        gathered.wait()  # the current stream waits for the all-gather's before unpacking
        _unwire_gathered(state, work)
    _hold_check(state, work)
    return gathered


def _reduce_and_gather(
    state: QuantizationState, work: Workspace, gather: Exchange = comm.all_gather_into
) -> torch.futures.Future[Any]:
    """The owner's pass (:func:`_reduce`), then the all-gather on the issuer's group (packed
    first, for a packed format)."""
    assert state.issuer is not None, "begin() made the issuer"
    wire, group = work.wire, state.issuer.group
    if wire is None:  # the packets travel as they are
        _reduce(state, work)
        return gather(work.gathered, work.own_packet, group)
    return _all_gather_wired(state, work, wire, group, gather)


def _held_decision(
    state: QuantizationState,
    work: Workspace,
    buffer: torch.Tensor,
    gathered: torch.futures.Future[Any] | None,
    last: bool,
) -> torch.futures.Future[torch.Tensor]:
    """Phase 3 held with the step's other buckets, where collectives complete as they are
    queued and follow-ups are held (a GPU's), once the all-gather is ``gathered`` (``None``:
    one rank, nothing travelled): the gathered scales are checked with every held bucket's
    at once, at the step's last bucket, with one batched pass and one read
    (:mod:`commhooks.hooks._held_sums`), and only then decoded; a bucket whose scales are
    not finite is sent again in full precision, in the issuer's order."""
    held = work.held_sums
    if held is None:
        assert state.issuer is not None, "begin() made the issuer"
        held = work.held_sums = held_sums(state.issuer)
    decision = _HeldDecision(state, work, buffer)
    return held.file(buffer, gathered, decision.rounds, last, decision)


class _HeldDecision:
    """Phase 3 of one bucket, held (:func:`_held_decision`): the finisher its held sums call."""

    __slots__ = ("buffer", "state", "work")

    def __init__(self, state: QuantizationState, work: Workspace, buffer: torch.Tensor) -> None:
        self.state, self.work, self.buffer = state, work, buffer

    def checked(self) -> torch.Tensor:
        """The gathered scales (the all-gather has completed; packed rows are unpacked)."""
        work = self.work
        if work.wire is not None:
            _unwire_gathered(self.state, work)
        return work.scales

    def apply(self) -> torch.Tensor:
        """Decode every row into the bucket and keep the errors (the scales are finite)."""
        _decode(self.state, self.work, self.buffer)
        return self.buffer

    def rounds(self, buffer: torch.Tensor) -> tuple[comm.Round]:
        """The repair of scales that are not finite: the bucket sent again plainly."""
        state = self.state
        return (lambda _: comm.Issue(lambda: _resend(state, buffer)),)


def _held_after(
    fut: torch.futures.Future[torch.Tensor], state: QuantizationState, work: Workspace
) -> torch.Tensor:
    """The all-gather's result, once its scales' check is held (raises if it failed)."""
    gathered = fut.value()
    _unwire_gathered(state, work)
    _hold_check(state, work)
    return gathered


def _hold_check(state: QuantizationState, work: Workspace) -> None:
    """Hold the check of the gathered scales with the step's others (see the module's note)."""
    finiteness.held_for(state.issuer).hold(work, work.scales)
    work.held = True


def _decode_or_resend(
    state: QuantizationState, work: Workspace, buffer: torch.Tensor
) -> "torch.futures.Future[torch.Tensor] | comm.Finished[torch.Tensor]":
    """Phase 3: decode every row into the bucket and keep the errors, or, if a scale is not
    finite (the same bytes, so the same answer, on every rank), send the bucket again plainly."""
    if _scales_finite(state, work):
        _decode(state, work, buffer)
        return comm.Finished(buffer)
    return _resend(state, buffer)  # the rows' padding is cleared at the next begin()


def _decode(state: QuantizationState, work: Workspace, buffer: torch.Tensor) -> None:
    """Decode every gathered row into the bucket; keep the step's errors as the memories."""
    layout, fmt = work.layout, work.fmt
    if layout.in_order:
        kernels = work.decode_kernels(buffer)
        blocks.decode_into_(work.gathered, fmt, buffer, work.levels, kernels=kernels)
    else:
        blocks.decode_into_(work.gathered, fmt, buffer, work.levels, layout.places())
    state.commit(work)


def _resend(state: QuantizationState, buffer: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in full precision on the issuer's group (its scales were not
    finite), with a warning if that average is finite."""
    assert state.issuer is not None, "begin() made the issuer"
    averaged = comm.average(buffer, state.issuer.group)
    return comm.then(averaged, lambda fut: _warn_if_finite(fut.value()))


def _scales_finite(state: QuantizationState, work: Workspace) -> bool:
    """Whether every gathered scale is finite: from the step's held checks, answered together
    at the first decision (one batched reduction and one read), where the check was held;
    otherwise read now (on a CPU, where that is free)."""
    if not work.held:
        return finiteness.QueuedFiniteness(work.scales).all_finite()
    work.held = False
    return finiteness.held_for(state.issuer).finite(work)


def _warn_if_finite(averaged: torch.Tensor) -> torch.Tensor:
    # A finite plain average means every gradient was finite: the quantized sum overflowed.
    if bool(torch.isfinite(averaged).all()):
        warn_once(
            "quantized-overflow",
            f"{_HOOK}: a bucket's quantized average went beyond float32's range although every "
            "gradient was finite, so that bucket was sent again in full precision. If this "
            "repeats, scale the loss down.",
        )
    return averaged
