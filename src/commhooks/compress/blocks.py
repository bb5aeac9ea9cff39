"""Quantization math: tensors to a few bits per element and back. Nothing here communicates.

* **Block quantization** (the quantized hook): each run of ``block`` elements gets a scale,
  ``absmax / qmax``, and each element the integer nearest to ``x / scale`` (or one of the two
  nearest, at random, with ``stochastic`` rounding), in ``[-qmax, qmax]``. Symmetric, so zero
  is exact and no zero point travels. 4-bit codes are stored offset by 8, two to a byte, the
  first element in the low nibble.
* **Min-max affine uint8** (PyTorch's per-tensor and per-channel drop-ins), as PyTorch's
  default observers compute it.

What travels is a *packet* per row: the codes, then the row's float32 scales, so that one
collective carries both (:class:`BlockFormat` says where each part lies). Functions work on
rows (``rows x length``, one per rank), writing into buffers the caller keeps from step to
step: allocating a bucket-sized tensor costs page faults at every step on a CPU.

Nearest rounding, decoding and the owner's pass run fused kernels, one read and one write of
the bucket instead of six: in C on a CPU (:mod:`.cpu_kernels`), in Triton on a CUDA GPU
(:mod:`.triton_launch`). The eager operations below compute the same bits everywhere else.
"""

import functools
import math
import sys
from dataclasses import dataclass

import torch

from commhooks.compress import cpu_kernels, triton_launch

__all__ = [
    "NEAREST",
    "RESIDUAL_SLACK",
    "ROUNDINGS",
    "STOCHASTIC",
    "BlockFormat",
    "affine_qparams",
    "dequantize_",
    "dequantize_affine",
    "dequantize_sum",
    "quantize_",
    "quantize_affine",
    "requantize_sum_",
    "decode_into_",
    "decode_parts",
]

NEAREST, STOCHASTIC = "nearest", "stochastic"
ROUNDINGS = (NEAREST, STOCHASTIC)

# A block of zeros gets this absmax instead of 0, so that 1 / scale stays finite; its elements
# still come back as exact zeros. Small enough never to matter, large enough that qmax / it
# fits in float32.
_SMALLEST_ABSMAX = 1e-30
# Added to 4-bit codes in [-8, 7] so that each nibble holds a value in [0, 15].
_NIBBLE_OFFSET = 8
# The largest code of a packed format: 13 levels (see commhooks.compress.packing).
_PACKED_QMAX = 6


RESIDUAL_SLACK = 1000.0
"""How far past its bound a loaded residual may be before it is reset (see
:meth:`BlockFormat.plausible_residual`)."""


@dataclass(frozen=True)
class BlockFormat:
    """How a row of elements is stored: ``bits`` per element and one float32 scale a block.

    Attributes:
        bits: 8 or 4.
        block: elements per scale; a multiple of 8, so that a row of whole blocks fills whole
            bytes at 4 bits and its scales start 4-byte aligned.
        packed: 4 bits only: codes of 13 levels, packed eight to 30 bits where they travel
            (:mod:`commhooks.compress.packing`; ``block`` a multiple of 32).
    """

    bits: int
    block: int
    packed: bool = False

    @functools.cached_property
    def qmax(self) -> int:
        """The largest code: 127 (8 bits), 7 (4 bits) or 6 (packed); read at every bucket."""
        return _PACKED_QMAX if self.packed else (1 << (self.bits - 1)) - 1

    def row_length(self, numel: int, rows: int) -> int:
        """Elements per row when ``numel`` elements are cut into ``rows`` rows of whole blocks."""
        return math.ceil(numel / (rows * self.block)) * self.block

    def payload_bytes(self, length: int) -> int:
        """Bytes of the codes of a row of ``length`` elements."""
        return length * self.bits // 8

    def packet_bytes(self, length: int) -> int:
        """Bytes a row of ``length`` elements takes on the wire: codes, then float32 scales."""
        return self.payload_bytes(length) + 4 * (length // self.block)

    def wire_bytes(self, length: int) -> int:
        """Bytes a row takes where it travels: its packet, or packed, ``15 / 32`` a code."""
        if not self.packed:
            return self.packet_bytes(length)
        return 4 * (length // self.block) + length // 32 * 15

    def plausible_residual(self, residual: torch.Tensor, gradient: torch.Tensor) -> bool:
        """Whether ``residual`` can be what quantizing to this format left out of ``gradient``.

        A residual is at most a step (``absmax / qmax``) of its block, which also holds the
        previous residual: in a steady state below ``max|gradient| / (qmax - 1)``. A loaded
        memory is refused past :data:`RESIDUAL_SLACK` times ``max|gradient| / qmax`` (the
        slack covers the difference), loose enough for a gradient
        smaller after a restart, far below one that would swamp it. Synchronises with the device.
        """
        if residual.numel() == 0 or gradient.numel() == 0:
            return True
        largest = float(residual.detach().abs().max())
        return largest <= RESIDUAL_SLACK * float(gradient.abs().max()) / self.qmax

    def split(self, packets: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of ``packets`` (``rows x packet_bytes``, uint8): the codes and the scales."""
        payload = self.payload_bytes(length)
        return packets[:, :payload], packets[:, payload:].view(torch.float32)


def quantize_(
    x: torch.Tensor,
    packets: torch.Tensor,
    fmt: BlockFormat,
    levels: torch.Tensor,
    *,
    rounding: str = NEAREST,
    generator: torch.Generator | None = None,
    keep_error: bool = True,
    add: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Quantize the rows of ``x`` into ``packets``; leave in ``x`` what quantization dropped.

    The error is at most half a step (``absmax / (2 qmax)`` of its block) with ``nearest``
    rounding, under a step and zero on average with ``stochastic``. A block holding inf or NaN
    gets a non-finite scale, which is how a receiver knows.

    Args:
        x: float32, ``rows x length``, rows of whole blocks; overwritten with the error when
            ``keep_error`` (the compensated gradient becomes the next memory in place).
        packets: uint8, ``rows x fmt.packet_bytes(length)``: written completely.
        levels: float32 scratch of ``x``'s shape.
        generator: the random numbers of stochastic rounding (on ``x``'s device).
        add: two float32 tensors of ``n`` elements whose sum first replaces the first ``n``
            elements of ``x``: the remembered error added in the quantizing pass where the
            fused kernels run. The first may be ``x`` itself, or its first ``n`` elements.
    """
    if rounding == NEAREST:
        args = (x, packets, fmt.bits, fmt.block, keep_error, add)
        if (x.is_cuda and triton_launch.quantize_rows(*args, qmax=fmt.qmax)) or (
            cpu_kernels.quantize_rows(*args, fmt.qmax)
        ):
            return
    if add is not None:
        # Flat, so that a first addend that is ``x`` itself overlaps the output exactly.
        first, second = add[0].view(-1), add[1].view(-1)
        torch.add(first, second, out=x.view(-1)[: first.numel()])
    rows, length = x.shape
    blocks = x.view(rows, length // fmt.block, fmt.block)
    payload, scales = fmt.split(packets, length)
    absmax = torch.maximum(blocks.amax(2), blocks.amin(2).neg_()).clamp_(min=_SMALLEST_ABSMAX)
    torch.div(absmax, fmt.qmax, out=scales)
    per_unit = absmax.reciprocal_().mul_(fmt.qmax).unsqueeze(2)
    steps = levels.view(rows, length // fmt.block, fmt.block)
    if rounding == STOCHASTIC:
        # round(v + u), u uniform in [-1/2, 1/2): v's lower or upper integer, with the
        # probability that makes the mean v. The clamp keeps a block's largest element in range.
        steps.uniform_(-0.5, 0.5, generator=generator).addcmul_(blocks, per_unit)
        steps.round_().clamp_(-fmt.qmax, fmt.qmax)
    else:
        torch.mul(blocks, per_unit, out=steps).round_()
    _store_codes(levels, payload, fmt)
    if keep_error:
        # x - level * scale with one rounding, as the kernels compute it. Written with the
        # scales negated rather than value=-1: PyTorch's CUDA addcmul rounds the product first
        # unless value is 1 (torch 2.11 on an H100: about 2% of the errors a bit apart).
        blocks.addcmul_(steps, scales.neg().unsqueeze(2))


def _store_codes(levels: torch.Tensor, payload: torch.Tensor, fmt: BlockFormat) -> None:
    """Write integral ``levels`` (float32, in [-qmax, qmax]) as codes into ``payload``."""
    if fmt.bits == 8:
        payload.view(torch.int8).copy_(levels)
        return
    codes = torch.empty(levels.shape, dtype=torch.int8, device=levels.device).copy_(levels)
    # As bytes, a code k < 0 reads k + 256; adding 8 to each nibble is done once on the packed
    # byte (8 + 16 * 8 = 136), where the sum wraps modulo 256 exactly as needed.
    pairs = codes.view(torch.uint8).view(levels.shape[0], -1, 2)
    torch.add(pairs[..., 0], pairs[..., 1], alpha=16, out=payload)
    payload.add_(_NIBBLE_OFFSET * 17)


def _codes(payload: torch.Tensor, fmt: BlockFormat, length: int) -> torch.Tensor:
    """The codes of ``payload`` as int8 (8 bits) or offset uint8 nibbles (4 bits)."""
    if fmt.bits == 8:
        return payload.view(torch.int8)
    rows = payload.shape[0]
    if sys.byteorder == "little":
        # Each byte widened to 16 bits with its high nibble moved up to the second byte: read
        # back as bytes, the nibbles in order. Contiguous passes, faster than strided writes.
        wide = payload.to(torch.int16)
        wide.bitwise_or_(wide << 4).bitwise_and_(0x0F0F)
        return wide.view(torch.uint8).view(rows, length)
    nibbles = torch.empty((rows, length // 2, 2), dtype=torch.uint8, device=payload.device)
    torch.bitwise_and(payload, 15, out=nibbles[..., 0])
    torch.bitwise_right_shift(payload, 4, out=nibbles[..., 1])
    return nibbles.view(rows, length)


def dequantize_(
    packets: torch.Tensor,
    fmt: BlockFormat,
    out: torch.Tensor,
    *,
    length: int | None = None,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode ``packets`` into ``out`` (``rows x columns``, any floating dtype); returns ``out``.

    The same bytes give the same bits on every rank.

    Args:
        length: elements per row of ``packets`` (default ``columns``); where ``out`` holds
            fewer (the end of a bucket), its rows get their packets' first ``columns``.
        scratch: float32 ``rows x length``, through which the eager form decodes such a row.
    """
    columns = out.shape[1]
    length = columns if length is None else length
    args = (packets, fmt.bits, fmt.block, out)
    if out.is_cuda and triton_launch.dequantize_rows(*args, length=length):
        return out
    if not cpu_kernels.dequantize_rows(*args, length=length):
        _decode_eager(packets, fmt, out, length, scratch)
    return out


def _decode_eager(
    packets: torch.Tensor,
    fmt: BlockFormat,
    out: torch.Tensor,
    length: int,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`dequantize_` in PyTorch's operations."""
    rows, columns = out.shape
    if columns < length:
        whole = torch.empty(rows, length, device=out.device) if scratch is None else scratch
        out.copy_(_decode_eager(packets, fmt, whole, length)[:, :columns])
        return out
    payload, scales = fmt.split(packets, length)
    out.copy_(_codes(payload, fmt, length))
    blocks = out.view(rows, length // fmt.block, fmt.block)
    step = scales.unsqueeze(2)
    if fmt.bits == 8:
        blocks.mul_(step)
    else:  # (nibble - 8) * scale, in one pass
        torch.addcmul(step * -_NIBBLE_OFFSET, blocks, step, out=blocks)
    return out


def dequantize_sum(
    packets: torch.Tensor, fmt: BlockFormat, scratch: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """The sum of the decoded rows of ``packets`` into ``out`` (float32, ``length``), through
    ``scratch`` (float32, ``rows x length``)."""
    row = out.view(1, -1)
    args = (packets, fmt.bits, fmt.block, row)
    if (out.is_cuda and triton_launch.dequantize_rows(*args, add_rows=True)) or (
        cpu_kernels.dequantize_rows(*args, add_rows=True)
    ):
        return out
    return _sum_in_row_order(_decode_eager(packets, fmt, scratch, row.shape[1]), row)[0]


def _sum_in_row_order(rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The sum of ``rows`` into ``out`` (``1 x length``), one row added after another, as the
    kernels add: ``torch.sum`` orders its additions as each device's reduction does (on CUDA,
    an int4 owner's packet came out a byte apart), and the bits must not depend on either."""
    if rows.shape[0] == 1:
        return out.copy_(rows)
    torch.add(rows[:1], rows[1:2], out=out)
    for row in range(2, rows.shape[0]):
        out.add_(rows[row : row + 1])
    return out


def requantize_sum_(
    packets: torch.Tensor,
    fmt: BlockFormat,
    out: torch.Tensor,
    packet: torch.Tensor,
    scratch: torch.Tensor,
    world: int,
    *,
    memory: torch.Tensor | None = None,
    rounding: str = NEAREST,
    generator: torch.Generator | None = None,
    keep_error: bool = True,
    kernels: "tuple[cpu_kernels.BoundDequantize, cpu_kernels.BoundQuantize] | None" = None,
) -> None:
    """The owner's pass: the mean of the decoded rows of ``packets``, plus ``memory``,
    quantized into ``packet``; what quantization dropped left in ``out``.

    :func:`dequantize_sum`, a division by ``world``, the addition of ``memory`` and
    :func:`quantize_`, with their bits; on a GPU with nearest rounding, one kernel launch.

    Args:
        packets: ``rows x fmt.packet_bytes(length)``: every rank's copy of this row.
        out: float32 ``1 x length``: the error when ``keep_error``, else the value quantized.
        packet: uint8 ``1 x fmt.packet_bytes(length)``, written completely.
        scratch: float32 ``rows x length``, overwritten.
        memory: float32, contiguous, at most ``length`` elements: the owner's remembered
            error, added to the mean's first elements before quantizing.
        kernels: a CPU's kernel calls bound to these tensors (the sum, then the quantization
            with ``memory`` added), tried first, without the general path's checks.
    """
    summed = kernels is not None and kernels[0]()
    if not summed:
        owner = (packets, fmt.bits, fmt.block, world, out, packet, keep_error, memory)
        on_gpu = rounding == NEAREST and out.is_cuda
        if on_gpu and triton_launch.requantize_rows(*owner, qmax=fmt.qmax):
            return
        # Where the owner's kernel does not run, neither does the GPU's decoding kernel
        # (stochastic rounding aside, which is PyTorch's operations anyway).
        if not cpu_kernels.dequantize_rows(packets, fmt.bits, fmt.block, out, add_rows=True):
            _sum_in_row_order(_decode_eager(packets, fmt, scratch, out.shape[1]), out)
    if world != 1:  # x / 1 is x, bit for bit
        out.div_(world)
    add = _added_in_place(out, memory)
    if summed and rounding == NEAREST and kernels is not None and kernels[1](add):
        return
    levels = scratch if scratch.shape[0] == 1 else scratch[:1]
    quantize_(
        out, packet, fmt, levels, rounding=rounding, generator=generator, keep_error=keep_error,
        add=add,
    )  # fmt: skip


def _added_in_place(
    out: torch.Tensor, memory: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``memory`` added to ``out``'s first elements: on a CPU, the addends of the quantizing
    pass (the same two tensors at every step, which a bound kernel checks once); on a GPU,
    now (its kernels read their addends apart from ``out``)."""
    if memory is None:
        return None
    whole = memory.shape == out.shape
    first = out if whole else out.view(-1)[: memory.numel()]
    second = memory if whole else memory.view(-1)
    if out.is_cuda:
        first.add_(second)
        return None
    return first, second


def decode_into_(
    packets: torch.Tensor,
    fmt: BlockFormat,
    out: torch.Tensor,
    scratch: torch.Tensor,
    places: list[tuple[int, int, int, int]] | None = None,
    kernels: "list[cpu_kernels.BoundDequantize] | None" = None,
) -> None:
    """Decode every row of ``packets`` into the flat ``out``: straight, row after row, or
    through ``scratch`` (float32, ``rows x length``), each ``(_, offset, size, source)`` of
    ``places`` taking ``size`` elements from ``offset`` in the rows to ``source`` in ``out``.
    ``kernels``: without ``places``, bound calls for the parts of :func:`decode_parts`."""
    if places is None and kernels and _all_ran(kernels):
        return
    length = scratch.shape[1]
    through = places is not None
    parts = [(packets, scratch, scratch)] if through else decode_parts(packets, out, scratch)
    for part, target, spare in parts:
        dequantize_(part, fmt, target, length=length, scratch=spare)
    if places:  # one batched copy: on a GPU one launch, not one a parameter
        decoded = scratch.view(-1)
        torch._foreach_copy_(
            [out[source : source + size] for _, _, size, source in places],
            [decoded[offset : offset + size] for _, offset, size, _ in places],
        )


def _all_ran(kernels: "list[cpu_kernels.BoundDequantize]") -> bool:
    """Run each bound call in turn, while they run; whether all did."""
    for kernel in kernels:  # noqa: SIM110 (all() over a generator: a frame more, a bucket)
        if not kernel():
            return False
    return True


def decode_parts(
    packets: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The rows of ``packets`` that decode straight into the flat ``out``, then the row in
    which ``out`` ends (its first elements): each with its target and its eager scratch."""
    rows, length = scratch.shape
    whole = out.numel() // length
    if whole == rows:
        return [(packets, out.view(rows, length), scratch)]
    if whole == 0 and rows == 1:
        return [(packets, out.view(1, -1), scratch)]
    straight = [(packets[:whole], out[: whole * length].view(whole, length), scratch[:whole])]
    end = out[whole * length :].view(1, -1)
    ragged = (packets[whole : whole + 1], end, scratch[whole : whole + 1])
    return [*straight, ragged] if whole else [ragged]


# ----------------------------------------------------------------------------------------------
# Min-max affine uint8, as PyTorch's quantization hooks compute it
# ----------------------------------------------------------------------------------------------
_UINT8_LEVELS = 255.0


def affine_qparams(channels: torch.Tensor) -> torch.Tensor:
    """Scale and zero point of each row of ``channels`` (float32), as PyTorch's observers:
    ``scale = max((max(hi, 0) - min(lo, 0)) / 255, eps)`` and ``zero_point = clamp(-round(
    min(lo, 0) / scale), 0, 255)``, so zero is exact. Float32 ``2 x rows``, the layout
    PyTorch's hooks exchange."""
    lo, hi = torch.aminmax(channels, dim=1)
    lo = torch.minimum(lo, torch.zeros_like(lo))
    hi = torch.maximum(hi, torch.zeros_like(hi))
    # The floor as a number, not a tensor made on the device: that copy from the host would
    # wait for the device at every bucket. The same bits as ``torch.maximum`` with it (NaN too).
    scale = ((hi - lo) / _UINT8_LEVELS).clamp_min_(torch.finfo(torch.float32).eps)
    zero_point = torch.clamp(-torch.round(lo / scale).to(torch.int), 0, 255)
    return torch.stack((scale, zero_point.to(torch.float32)))


def quantize_affine(channels: torch.Tensor, qparams: torch.Tensor, out: torch.Tensor) -> None:
    """``clamp(round(x / scale) + zero_point, 0, 255)`` per row, into uint8 ``out``."""
    scale, zero_point = qparams[0].unsqueeze(1), qparams[1].unsqueeze(1)
    levels = torch.round(channels / scale).add_(zero_point).clamp_(0, 255)
    out.copy_(levels)


def dequantize_affine(codes: torch.Tensor, qparams: torch.Tensor) -> torch.Tensor:
    """``scale * (code - zero_point)`` per row, in float32."""
    scale, zero_point = qparams[0].unsqueeze(1), qparams[1].unsqueeze(1)
    return scale * (codes.to(torch.float32) - zero_point)
