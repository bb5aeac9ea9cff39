"""The quantized average's phases, shared by its flat path (:mod:`.hook`) and its two-hop
path (:mod:`.two_hops`): quantize a rank's rows and exchange them, the owner's pass and the
all-gather, decode and keep the errors. Each issues at most one collective.

Hook modules must not use ``from __future__ import annotations``: DDP rejects string annotations.
"""

from typing import Any

import torch
import torch.distributed as dist

from commhooks import comm
from commhooks.compress import blocks, packing
from commhooks.hooks.quantized.layout import Workspace
from commhooks.hooks.quantized.state import QuantizationState

__all__ = ["decode_and_commit", "exchange_rows", "quantize_rows", "reduce", "reduce_and_gather"]


def quantize_rows(state: QuantizationState, work: Workspace) -> None:
    """Phase 1's quantization of this rank's compensated gradient, bound call first."""
    settings = state.settings
    bound = work.now.quantize  # a CPU's call bound to these buffers (none on a GPU)
    if bound is None or settings.rounding != blocks.NEAREST or not bound(work.addition):
        blocks.quantize_(
            work.rows, work.send, work.fmt, work.levels, rounding=settings.rounding,
            generator=work.first, keep_error=settings.error_feedback, add=work.addition,
        )  # fmt: skip


def exchange_rows(work: Workspace, group: dist.ProcessGroup) -> torch.futures.Future[Any]:
    """Phase 1's exchange, the all-to-all (the packets packed first, for a packed format)."""
    wire = work.wire
    if wire is None:  # the packets travel as they are
        return comm.all_to_all(work.received, work.send, group)
    packing.to_wire_(work.send, work.fmt, work.layout.length, wire.send)
    return comm.all_to_all(wire.received, wire.send, group)


def reduce(state: QuantizationState, work: Workspace) -> None:
    """The owner's pass: average this rank's row, add its remembered error and quantize it
    again, in one pass where a kernel takes it."""
    settings, memory = state.settings, state.owner_memory(work)
    blocks.requantize_sum_(
        work.received, work.fmt, work.now.mine, work.own_packet, work.levels, work.world,
        memory=memory, rounding=settings.rounding, generator=work.second,
        keep_error=settings.error_feedback, kernels=work.now.owner,
    )  # fmt: skip


def reduce_and_gather(
    state: QuantizationState, work: Workspace, group: dist.ProcessGroup
) -> torch.futures.Future[Any]:
    """Phase 2, in the issuer's turn: the owner's pass (:func:`reduce`), then the all-gather
    on ``group`` (the received rows unpacked first and this rank's packet packed
    after, for a packed format)."""
    wire, fmt, length = work.wire, work.fmt, work.layout.length
    if wire is None:  # the packets travel as they are
        reduce(state, work)
        return comm.all_gather_into(work.gathered, work.own_packet, group)
    packing.from_wire_(wire.received, fmt, length, work.received)
    reduce(state, work)
    packing.to_wire_(work.own_packet, fmt, length, wire.own)
    return comm.all_gather_into(wire.gathered, wire.own, group)


def decode_and_commit(
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
