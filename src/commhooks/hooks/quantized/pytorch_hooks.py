"""PyTorch's uint8 quantization hooks, with their names and arguments, working on every backend.

They quantize the bucket with PyTorch's min-max affine uint8 scheme (one scale and zero point
for the bucket, or each run of ``bucket_size`` elements), all-gather every rank's codes and
average them decoded in float32: PyTorch's numbers, bit for bit on float32 buckets. Unlike
PyTorch's (which fail on gloo), they run on any backend and send the scales with the codes in
one all-gather. Each rank receives every rank's whole bucket, so beyond a few ranks prefer
:func:`~commhooks.hooks.quantized.hook.quantized_hook`. A non-finite gradient makes its whole
channel non-finite.

Hook modules must not use ``from __future__ import annotations``: DDP rejects string annotations.
"""

import math

import torch
import torch.distributed as dist

from commhooks import comm
from commhooks.compress import blocks
from commhooks.hooks._bucket import GradBucket, float_buffer, group_state
from commhooks.options import integer

__all__ = ["quantization_perchannel_hook", "quantization_pertensor_hook"]

_QPARAM_BYTES = 8  # a float32 scale and a float32 zero point per channel


def quantization_pertensor_hook(
    process_group: dist.ProcessGroup,
    bucket: GradBucket,
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket as uint8 codes with one scale and zero point per rank.

    Args:
        process_group: group to average over; ``None`` for the default group.
        bucket: the gradient bucket DDP hands to the hook.
    """
    owner = "quantization_pertensor_hook"
    group = group_state(process_group, owner)
    buffer = float_buffer(bucket, owner)
    return _affine_average(buffer, max(1, buffer.numel()), group)


def quantization_perchannel_hook(
    process_group: dist.ProcessGroup,
    bucket: GradBucket,
    bucket_size: int = 512,
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket as uint8 codes with a scale and zero point per ``bucket_size`` run.

    Args:
        process_group: group to average over; ``None`` for the default group.
        bucket: the gradient bucket DDP hands to the hook.
        bucket_size: elements per channel; the bucket is zero-padded to whole channels.
    """
    owner = "quantization_perchannel_hook"
    size = integer(1, hint="elements per channel, e.g. 512")(owner, "bucket_size", bucket_size)
    group = group_state(process_group, owner)
    return _affine_average(float_buffer(bucket, owner), size, group)


def _affine_average(
    buffer: torch.Tensor, channel: int, group: dist.ProcessGroup
) -> torch.futures.Future[torch.Tensor]:
    """Quantize ``buffer`` in channels of ``channel`` elements, all-gather, average decoded."""
    numel = buffer.numel()
    if numel == 0:
        return comm.completed(buffer)
    rows = math.ceil(numel / channel)
    channels = torch.zeros(rows, channel, device=buffer.device)
    channels.view(-1)[:numel].copy_(buffer)
    qparams = blocks.affine_qparams(channels)
    codes_bytes = _aligned(rows * channel)
    size = codes_bytes + _QPARAM_BYTES * rows
    packet = torch.empty(1, size, dtype=torch.uint8, device=buffer.device)
    blocks.quantize_affine(channels, qparams, packet[0, : rows * channel].view(rows, channel))
    packet[0, codes_bytes:].view(torch.float32).copy_(qparams.view(-1))
    gathered = packet.new_empty(group.size(), packet.shape[1])
    done = comm.all_gather_into(gathered, packet, group)
    return comm.then(done, lambda fut: _decode_average(fut.value(), buffer, rows, channel))


def _aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of 4, where float32 values may start."""
    return (nbytes + 3) // 4 * 4


def _decode_average(
    gathered: torch.Tensor, buffer: torch.Tensor, rows: int, channel: int
) -> torch.Tensor:
    """Sum the ranks' decoded buckets in rank order from zero, divide: PyTorch's arithmetic."""
    total = torch.zeros(rows, channel, device=buffer.device)
    codes_bytes = _aligned(rows * channel)
    for packet in gathered:
        codes = packet[: rows * channel].view(rows, channel)
        qparams = packet[codes_bytes:].view(torch.float32).view(2, rows)
        total += blocks.dequantize_affine(codes, qparams)
    averaged = total.view(-1)[: buffer.numel()] / gathered.shape[0]
    comm.used_on_current_stream([gathered])  # made on DDP's stream, read on this one
    return buffer.copy_(averaged)
