"""Quantized averaging with error feedback: 8 or 4 bits per element on the wire, any backend.

Per bucket, in two phases (the scheme of ZeRO++'s qgZ and torchft's quantized allreduce):

1. Each rank adds its remembered error to its gradient, cuts it into one row per rank,
   quantizes it in blocks with a scale each, and keeps what was dropped as its next error. An
   all-to-all hands each rank every rank's copy of the row it owns.
2. The owner decodes and sums those copies in float32, divides, adds the error it remembers
   for that row, quantizes again (keeping that error too), and an all-gather hands everyone
   every row: every rank decodes the same bytes, so holds the same bits.

Each rank sends ``2 (p - 1) / p`` of the bucket at ``bits`` per element plus a float32 scale a
block: with 256-element blocks, 0.254 (int8) or 0.129 (int4) of a float32 ring allreduce's
bytes, at any world size; 0.121 with ``packed`` 4-bit codes (:mod:`commhooks.compress.packing`).

Hook modules must not use ``from __future__ import annotations``: DDP rejects string annotations.
"""

import torch
import torch.distributed as dist

from commhooks import comm
from commhooks.hooks._bucket import GradBucket, float_buffer
from commhooks.hooks.quantized import phases
from commhooks.hooks.quantized.options import QuantizationOptions
from commhooks.hooks.quantized.state import HOOK, QuantizationState
from commhooks.hooks.quantized.two_hops import average_two_hops
from commhooks.hooks.repair import REPAIR, repaired

__all__ = ["QuantizationOptions", "QuantizationState", "quantized_hook"]


def quantized_hook(
    state: QuantizationState,
    bucket: GradBucket,
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with 8- or 4-bit blocks on the wire, remembering what was dropped.

    Plain allreduce for the first ``state.warmup_steps`` steps. Then the two phases of the
    module docstring: an all-to-all issued here, on DDP's thread, and an all-gather through
    the state's ordered issuer, so that many buckets issue in the same order on every rank.

    Accuracy: with nearest rounding, each element of the result is within
    ``(mean over ranks of a1 + a2) / (2 qmax)`` of the exact average of the compensated
    gradients (plus float32 rounding), where ``a1`` is the absolute maximum of the element's
    block of a rank's compensated gradient, ``a2`` that of its block of the average, and
    ``qmax`` is 127 (int8) or 7 (int4); in particular within ``max|g| / qmax`` over the bucket.
    With error feedback, nothing is lost over steps: what a step applies plus the new memories
    (the ranks' mean first memory plus the owners' second) equals the exact average plus the
    previous memories.

    A block holding inf or NaN makes a gathered scale non-finite, on every rank alike: the
    bucket comes back non-finite, as plain allreduce's would (a loss scaler skips the step),
    and both memories keep what they held, chosen on the device. With
    ``on_nonfinite="repair"`` such a bucket is averaged again in full precision.

    Args:
        state: the :class:`QuantizationState` with the options and memories.
        bucket: the gradient bucket DDP hands to the hook (or anything with its methods).
    """
    if type(state) is not QuantizationState and not isinstance(state, QuantizationState):
        raise TypeError(  # (the exact type first: no isinstance a bucket)
            f"{HOOK} needs a commhooks.QuantizationState as its state, got "
            f"{type(state).__name__}. Register it as "
            f"ddp_model.register_comm_hook(QuantizationState(None, bits=8), {HOOK})."
        )
    float_buffer(bucket, HOOK)
    group = state.prepare()
    return state.buckets.average(bucket, state.number, lambda part: _step(state, part, group))


def _step(
    state: QuantizationState, bucket: GradBucket, group: dist.ProcessGroup
) -> torch.futures.Future[torch.Tensor]:
    """One bucket's average (DDP's, or one of the saved buckets DDP's are cut into after a
    load: :class:`~commhooks.hooks.buckets.SavedBuckets`)."""
    buffer = bucket.buffer()
    if state.settings.on_nonfinite == REPAIR:
        return repaired(REPAIR, bucket, group, HOOK, lambda: _average(state, bucket, buffer, group))
    return _average(state, bucket, buffer, group)


def _average(
    state: QuantizationState, bucket: GradBucket, buffer: torch.Tensor, group: dist.ProcessGroup
) -> torch.futures.Future[torch.Tensor]:
    """The hook's step, flat or on the two-hop path (:mod:`.two_hops`). A group of one rank
    sends nothing: its packets are what the exchanges would hand back."""
    if state.hops is not None:
        return average_two_hops(state, bucket, buffer, group)
    work = state.begin(bucket, buffer, bucket.is_last())
    if work is None:  # the warm-up, or an empty bucket
        return comm.average(buffer, group) if buffer.numel() else comm.completed(buffer)
    phases.quantize_rows(state, work)
    if work.alone:  # nothing travels: the packets are what the exchanges would hand back
        phases.reduce(state, work)
        return comm.completed(phases.decode_and_commit(state, work, buffer))
    issuer = state.issuer
    assert issuer is not None, "prepare() made the issuer"
    exchanged = phases.exchange_rows(work, group)
    gathered = issuer.then(exchanged, lambda _: phases.reduce_and_gather(state, work, issuer.group))
    return comm.then(gathered, lambda fut: phases.decode_and_commit(state, work, buffer, fut))
