"""Quantized averaging with error feedback: 8 or 4 bits per element on the wire, any backend.

Per bucket, in two phases (the scheme of ZeRO++'s qgZ and torchft's quantized allreduce):

1. Each rank adds its remembered error to its gradient, cuts the zero-padded result into one
   row per rank, quantizes it in blocks with a scale each (:mod:`commhooks.hooks.quantized.blocks`),
   and keeps what was dropped as its next error. An all-to-all hands each rank every rank's copy
   of the row it owns.
2. The owner decodes and sums those copies in float32, divides by the world size, adds the
   error it remembers for that row, quantizes the average again (keeping that error too), and
   an all-gather hands everyone every row. Every rank decodes the same bytes, so the result is
   the same on every rank, bit for bit.

Each rank sends ``2 (p - 1) / p`` of the bucket at ``bits`` per element plus a float32 scale
per block: with the default 256-element blocks, 0.254 (int8) or 0.129 (int4) of what a
float32 ring allreduce sends, at any world size.

Hook modules must not use ``from __future__ import annotations``: DDP rejects string annotations.
"""

from typing import Any

import torch
import torch.distributed as dist

from commhooks import callbacks, comm
from commhooks._warnings import warn_once
from commhooks.hooks._bucket import GradBucket, float_buffer
from commhooks.hooks.quantized import blocks
from commhooks.hooks.quantized.state import (
    HOOK,
    QuantizationOptions,
    QuantizationState,
    Workspace,
)

__all__ = ["QuantizationOptions", "QuantizationState", "quantized_hook"]

_HOOK = HOOK
_OWN_ROW, _AVERAGE = 0, 1  # the two quantizations, each with its own random numbers


def quantized_hook(
    state: QuantizationState,
    bucket: GradBucket,
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with 8- or 4-bit blocks on the wire, remembering what was dropped.

    Plain allreduce for the first ``state.warmup_steps`` steps. Then the two phases of the
    module docstring: an all-to-all issued here, on DDP's thread, and an all-gather started
    when it completes, through the state's ordered issuer, so that many buckets issue their
    collectives in the same order on every rank.

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
    state = _check_state(state)
    buffer = float_buffer(bucket, _HOOK)
    group = state.prepare()
    if not state.compressing(bucket.is_last()):
        return comm.average(buffer, group)
    if buffer.numel() == 0:
        return comm.completed(buffer)
    world, rank = comm.world_size(group), comm.group_rank(group)
    work = state.workspace(bucket.index(), state.layout(bucket, group), world, buffer.device)
    addition = _compensate(state, work, buffer)
    first = state.generator(buffer.device, rank, _OWN_ROW)
    _quantize(state, work.rows, work.send, work.levels, first, addition)
    exchanged = comm.all_to_all(work.received, work.send, group)
    issuer = state.issuer
    assert issuer is not None, "prepare() made the issuer"
    follow_up = comm.follow_up_options(buffer, bucket.is_last())
    second = state.generator(buffer.device, rank, _AVERAGE)
    # Both rounds touch the state's memories: they run in their turns, one at a time.
    rounds = (
        lambda _: comm.Issue(lambda: _reduce_and_share(state, work, second, issuer.group)),
        lambda _: comm.Issue(lambda: _decode_or_resend(state, work, buffer, issuer.group)),
    )
    return issuer.rounds(exchanged, rounds, *follow_up)


def _check_state(state: Any) -> QuantizationState:
    if not isinstance(state, QuantizationState):
        raise TypeError(
            f"{_HOOK} needs a commhooks.QuantizationState as its state, got "
            f"{type(state).__name__}. Register it as "
            f"ddp_model.register_comm_hook(QuantizationState(None, bits=8), {_HOOK})."
        )
    return state


def _compensate(
    state: QuantizationState, work: Workspace, buffer: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Fill ``work.rows`` with the gradient plus each parameter's remembered error, or return
    the two tensors whose sum its start must become, for the quantizing pass to add.

    Out of place: the bucket keeps the plain gradient, which a re-send needs.
    """
    flat, n, layout = work.rows.view(-1), buffer.numel(), work.layout
    flat[n:].zero_()  # an abandoned step may have left inf or NaN in the padding
    places = layout.places()
    if not state.settings.error_feedback:
        found: list[torch.Tensor | None] = [None] * len(places)
    else:
        found = [state.error.get(number, flat[o : o + size]) for number, o, size, _ in places]
    if layout.in_order and all(r is None for r in found):
        flat[:n].copy_(buffer)
    elif layout.in_order and _left_in_place(found, work, places):
        # The usual step: the last step's errors are still where it left them, in order.
        return buffer, work.spare.view(-1)[:n]
    else:
        for residual, (_, offset, size, source) in zip(found, places):
            row, grad = flat[offset : offset + size], buffer[source : source + size]
            if residual is None:
                row.copy_(grad)
            else:
                torch.add(grad, residual, out=row)
    return None


def _left_in_place(
    found: list[torch.Tensor | None], work: Workspace, places: list[tuple[int, int, int, int]]
) -> bool:
    """Whether every error is a view of ``work.spare`` at its parameter's place in the rows."""
    spare = work.spare.view(-1)
    start, width = spare.data_ptr(), spare.element_size()
    return all(
        r is not None and r.data_ptr() == start + offset * width
        for r, (_, offset, _, _) in zip(found, places)
    )


def _quantize(
    state: QuantizationState,
    rows: torch.Tensor,
    packets: torch.Tensor,
    levels: torch.Tensor,
    generator: torch.Generator | None,
    addition: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    settings = state.settings
    blocks.quantize_(
        rows,
        packets,
        settings.format,
        levels,
        rounding=settings.rounding,
        generator=generator,
        keep_error=settings.error_feedback,
        add=addition,
    )


def _reduce_and_share(
    state: QuantizationState,
    work: Workspace,
    generator: torch.Generator | None,
    group: dist.ProcessGroup | None,
) -> torch.futures.Future[torch.Tensor]:
    """Phase 2, on the thread that completed the all-to-all: average this rank's row,
    quantize it again, and start the all-gather on the issuer's group."""
    assert group is not None, "the issuer has its follow-up group"
    fmt = state.settings.format
    blocks.dequantize_sum(work.received, fmt, work.levels, work.mine[0])
    work.mine.div_(group.size())
    if state.settings.error_feedback:
        for key, start, stop in work.layout.pieces:
            state.owner_error.compensate_(key, work.mine[0, start:stop])
    _quantize(state, work.mine, work.own_packet, work.levels[:1], generator)
    return comm.all_gather_into(work.gathered, work.own_packet, group)


def _decode_or_resend(
    state: QuantizationState,
    work: Workspace,
    buffer: torch.Tensor,
    group: dist.ProcessGroup | None,
) -> "torch.futures.Future[torch.Tensor] | comm.Finished[torch.Tensor]":
    """Phase 3: decode every row into the bucket and keep the errors, or, if a scale is not
    finite (the same bytes, so the same answer, on every rank), send the bucket again plainly."""
    assert group is not None, "the issuer has its follow-up group"
    fmt, length = state.settings.format, work.layout.length
    if not blocks.scales_finite(work.gathered, fmt, length):
        return callbacks.then(comm.average(buffer, group), lambda fut: _warn_if_finite(fut.value()))
    _decode(work, fmt, buffer)
    state.commit(work)
    return comm.Finished(buffer)


def _decode(work: Workspace, fmt: blocks.BlockFormat, buffer: torch.Tensor) -> None:
    """Decode the gathered rows into the bucket: straight into it when its order is the
    layout's (rows entirely inside it), through scratch otherwise."""
    layout, gathered, n = work.layout, work.gathered, buffer.numel()
    whole = n // layout.length if layout.in_order else 0  # rows decoded straight into buffer
    rows = buffer[: whole * layout.length].view(whole, layout.length)
    blocks.dequantize_(gathered[:whole], fmt, rows)
    if whole == gathered.shape[0]:
        return
    if layout.in_order:  # the bucket ends in row `whole`: its first elements, decoded in place
        end = buffer[whole * layout.length :].view(1, -1)
        scratch = work.levels[whole : whole + 1]
        blocks.dequantize_(
            gathered[whole : whole + 1], fmt, end, length=layout.length, scratch=scratch
        )
        return
    decoded = blocks.dequantize_(gathered, fmt, work.levels).view(-1)
    for _, offset, size, source in layout.places():
        buffer[source : source + size].copy_(decoded[offset : offset + size])


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
