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

A block holding inf or NaN gives the gathered result a scale that is not finite, which every
rank sees alike: the bucket then decodes to inf or NaN where plain allreduce has them too, and
the memories keep what they held before the step, chosen on the device from the gathered
scales (no read back to the host). ``on_nonfinite="repair"`` averages such a bucket again in
full precision (:mod:`commhooks.hooks.repair`).

Each rank sends ``2 (p - 1) / p`` of the bucket at ``bits`` per element plus a float32 scale
per block: with the default 256-element blocks, 0.254 (int8) or 0.129 (int4) of what a
float32 ring allreduce sends, at any world size; 0.121 with ``packed`` 4-bit codes, 13 levels
eight to 30 bits (:mod:`commhooks.compress.packing`), packed before each exchange and
unpacked after it.

Hook modules must not use ``from __future__ import annotations``: DDP rejects string annotations.
"""

from typing import Any

import torch
import torch.distributed as dist

from commhooks import comm
from commhooks.compress import blocks, packing
from commhooks.hooks._bucket import GradBucket, float_buffer
from commhooks.hooks.quantized.state import HOOK, QuantizationOptions, QuantizationState, Workspace
from commhooks.hooks.repair import REPAIR, repaired

__all__ = ["QuantizationOptions", "QuantizationState", "quantized_hook"]


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
    non-finite, which every rank sees alike; the bucket comes back non-finite, as plain
    allreduce's would (a loss scaler skips the step), and both memories keep what they held.
    With ``on_nonfinite="repair"`` such a bucket is averaged again in full precision.

    Args:
        state: the :class:`QuantizationState` with the options and memories.
        bucket: the gradient bucket DDP hands to the hook (or anything with its methods).
    """
    if type(state) is not QuantizationState:  # (the exact type: no isinstance a bucket)
        state = _check_state(state)
    buffer = float_buffer(bucket, HOOK)
    group = state.prepare()
    if state.settings.on_nonfinite == REPAIR:
        return repaired(REPAIR, bucket, group, HOOK, lambda: _average(state, bucket, buffer, group))
    return _average(state, bucket, buffer, group)


def _check_state(state: Any) -> QuantizationState:
    if not isinstance(state, QuantizationState):
        raise TypeError(
            f"{HOOK} needs a commhooks.QuantizationState as its state, got "
            f"{type(state).__name__}. Register it as "
            f"ddp_model.register_comm_hook(QuantizationState(None, bits=8), {HOOK})."
        )
    return state


def _average(
    state: QuantizationState, bucket: GradBucket, buffer: torch.Tensor, group: dist.ProcessGroup
) -> torch.futures.Future[torch.Tensor]:
    """The hook's step: quantize, exchange, the owner's pass and the all-gather, decode."""
    work = state.begin(bucket, buffer, bucket.is_last())
    if work is None:  # the warm-up, or an empty bucket
        return comm.average(buffer, group) if buffer.numel() else comm.completed(buffer)
    _quantize_rows(state, work)
    if work.alone:  # nothing travels: the packets are what the exchanges would hand back
        _reduce(state, work)
        return comm.completed(_finish(state, work, buffer))
    issuer = state.issuer
    assert issuer is not None, "prepare() made the issuer"
    exchanged = _exchange_rows(work, group)
    gathered = issuer.then(exchanged, lambda _: _reduce_and_gather(state, work, issuer.group))
    return comm.then(gathered, lambda fut: _finish(state, work, buffer, fut))


def _quantize_rows(state: QuantizationState, work: Workspace) -> None:
    """Phase 1's quantization of this rank's compensated gradient, bound call first."""
    settings = state.settings
    bound = work.now.quantize  # a CPU's call bound to these buffers (none on a GPU)
    if bound is None or settings.rounding != blocks.NEAREST or not bound(work.addition):
        blocks.quantize_(
            work.rows, work.send, work.fmt, work.levels, rounding=settings.rounding,
            generator=work.first, keep_error=settings.error_feedback, add=work.addition,
        )  # fmt: skip


def _exchange_rows(work: Workspace, group: dist.ProcessGroup) -> torch.futures.Future[Any]:
    """Phase 1's exchange, the all-to-all (the packets packed first, for a packed format)."""
    wire = work.wire
    if wire is None:  # the packets travel as they are
        return comm.all_to_all(work.received, work.send, group)
    packing.to_wire_(work.send, work.fmt, work.layout.length, wire.send)
    return comm.all_to_all(wire.received, wire.send, group)


def _reduce(state: QuantizationState, work: Workspace) -> None:
    """The owner's pass: average this rank's row, add its remembered error and quantize it
    again, in one pass where a kernel takes it."""
    settings, memory = state.settings, state.owner_memory(work)
    blocks.requantize_sum_(
        work.received, work.fmt, work.now.mine, work.own_packet, work.levels, work.world,
        memory=memory, rounding=settings.rounding, generator=work.second,
        keep_error=settings.error_feedback, kernels=work.now.owner,
    )  # fmt: skip


def _reduce_and_gather(
    state: QuantizationState, work: Workspace, group: dist.ProcessGroup
) -> torch.futures.Future[Any]:
    """Phase 2, in the issuer's turn: the owner's pass (:func:`_reduce`), then the all-gather
    on the issuer's group (the received rows unpacked first and this rank's packet packed
    after, for a packed format)."""
    wire, fmt, length = work.wire, work.fmt, work.layout.length
    if wire is None:  # the packets travel as they are
        _reduce(state, work)
        return comm.all_gather_into(work.gathered, work.own_packet, group)
    packing.from_wire_(wire.received, fmt, length, work.received)
    _reduce(state, work)
    packing.to_wire_(work.own_packet, fmt, length, wire.own)
    return comm.all_gather_into(wire.gathered, wire.own, group)


def _finish(
    state: QuantizationState,
    work: Workspace,
    buffer: torch.Tensor,
    gathered: torch.futures.Future[Any] | None = None,
) -> torch.Tensor:
    """Phase 3: decode every gathered row into the bucket and keep the step's errors as the
    memories, where the gathered scales are all finite (decided on the device, see
    :meth:`QuantizationState.commit`)."""
    if gathered is not None:
        gathered.wait()  # raises if the all-gather failed; on a GPU, orders the streams
    if work.wire is not None:
        packing.from_wire_(work.wire.gathered, work.fmt, work.layout.length, work.gathered)
    layout = work.layout
    if layout.in_order:
        kernels = work.decode_kernels(buffer)
        blocks.decode_into_(work.gathered, work.fmt, buffer, work.levels, kernels=kernels)
    else:
        blocks.decode_into_(work.gathered, work.fmt, buffer, work.levels, layout.places())
    state.commit(work)
    return buffer
