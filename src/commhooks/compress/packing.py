"""4-bit codes of 13 levels, packed eight to 30 bits: 3.75 bits a value on the wire.

With its block's float32 scale a 4-bit code takes 4.125 bits. Where what is sent must fit in 4
bits a value (DiLoCo's outer gradients), the codes keep 13 levels (``[-6, 6]``): eight take 30
bits (``13 ** 8 < 2 ** 30``), 3.875 bits a value with the scale, at steps 7/6 as coarse, which
error feedback makes up later.

Quantization is unchanged (``qmax`` 6) and packets stay nibbles in memory; only what travels
is packed: :func:`to_wire_` before a collective, :func:`from_wire_` after. A wire packet is the
row's scales, then its codes as ``cpu_kernels/_base13.c`` lays them out (four values of eight
codes in 15 bytes: each value's low three bytes, then their four top 6-bit parts as one 24-bit
number). The C kernel and the operations below give the same bytes, and any bytes unpack to
codes in range.
"""

import functools

import torch

from commhooks.compress import cpu_kernels
from commhooks.compress.blocks import BlockFormat

__all__ = ["CODES_PER_GROUP", "from_wire_", "pack13_", "packed_bytes", "to_wire_", "unpack13_"]

CODES_PER_GROUP = 32
"""Codes packed together (into 15 bytes): a packed row's length is a multiple of it."""
_GROUP_BYTES = 15
_LEVELS = 13
_LOWEST = 2  # the nibble of code -6 (codes are stored offset by 8)
_PAIR_BASE = _LEVELS * _LEVELS  # one byte's two codes as one number


def packed_bytes(length: int) -> int:
    """Bytes of a row of ``length`` codes, packed (``length`` a multiple of 32)."""
    return length // CODES_PER_GROUP * _GROUP_BYTES


def to_wire_(packets: torch.Tensor, fmt: BlockFormat, length: int, wire: torch.Tensor) -> None:
    """Write ``packets`` (``rows x fmt.packet_bytes(length)``, nibbles of 13 levels) into
    ``wire`` (``rows x fmt.wire_bytes(length)``): the scales' bytes, then the packed codes."""
    payload = fmt.payload_bytes(length)
    scales = packets.shape[1] - payload
    wire[:, :scales].copy_(packets[:, payload:])
    pack13_(packets[:, :payload], wire[:, scales:])


def from_wire_(wire: torch.Tensor, fmt: BlockFormat, length: int, packets: torch.Tensor) -> None:
    """The inverse of :func:`to_wire_`: ``wire`` back into ``packets``."""
    payload = fmt.payload_bytes(length)
    scales = packets.shape[1] - payload
    packets[:, payload:].copy_(wire[:, :scales])
    unpack13_(wire[:, scales:], packets[:, :payload])


def pack13_(nibbles: torch.Tensor, out: torch.Tensor) -> None:
    """Pack ``nibbles`` (``rows x 16 g`` bytes, two codes a byte, each nibble in [2, 14])
    into ``out`` (``rows x 15 g``)."""
    if cpu_kernels.pack13(nibbles, out):
        return
    rows, groups = nibbles.shape[0], nibbles.shape[1] // 16
    powers, shifts = _constants(nibbles.device)
    wide = nibbles.to(torch.int32)
    pairs = (wide >> 4).mul_(_LEVELS).add_(wide & 15).sub_(_LOWEST * (_LEVELS + 1))
    values = pairs.view(rows, groups, 4, 4).mul_(powers).sum(-1, dtype=torch.int32)
    top = ((values >> 24) << shifts).sum(-1, dtype=torch.int32)
    packed = out.view(rows, groups, _GROUP_BYTES)
    packed[..., :12].view(rows, groups, 4, 3).copy_(_low_bytes(values, 3))
    packed[..., 12:].copy_(_low_bytes(top, 3))


def unpack13_(packed: torch.Tensor, nibbles: torch.Tensor) -> None:
    """The inverse of :func:`pack13_`: ``packed`` (``rows x 15 g``) into ``nibbles``
    (``rows x 16 g``); each number is taken apart modulo 169 and 13, so that any bytes give
    nibbles in [2, 14]."""
    if cpu_kernels.unpack13(packed, nibbles):
        return
    rows, groups = packed.shape[0], packed.shape[1] // _GROUP_BYTES
    powers, shifts = _constants(packed.device)
    wide = packed.view(rows, groups, _GROUP_BYTES).to(torch.int32)
    values = _from_bytes(wide[..., :12].reshape(rows, groups, 4, 3))
    top = _from_bytes(wide[..., 12:]).unsqueeze(-1)
    values.bitwise_or_(((top >> shifts) & 63) << 24)
    pairs = torch.div(values.unsqueeze(-1), powers, rounding_mode="floor").remainder_(_PAIR_BASE)
    low = pairs.remainder(_LEVELS).add_(_LOWEST)
    high = pairs.div_(_LEVELS, rounding_mode="floor").add_(_LOWEST)
    nibbles.view(rows, groups, 16).copy_(low.bitwise_or_(high << 4).view(rows, groups, 16))


def _low_bytes(values: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` lowest bytes of int32 ``values``, least significant first, on a new last
    dimension (in any byte order of the machine)."""
    return torch.stack([(values >> (8 * k)) & 255 for k in range(count)], dim=-1)


def _from_bytes(parts: torch.Tensor) -> torch.Tensor:
    """The number whose bytes, least significant first, are the last dimension of ``parts``."""
    out = parts[..., 0].clone()
    for k in range(1, parts.shape[-1]):
        out.bitwise_or_(parts[..., k] << (8 * k))
    return out


@functools.cache
def _constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The powers of 169 that weigh a value's four pairs, and the shifts of the four top
    parts in their 24-bit number, on ``device``."""
    powers = torch.tensor([_PAIR_BASE**k for k in range(4)], dtype=torch.int32, device=device)
    return powers, torch.tensor([0, 6, 12, 18], dtype=torch.int32, device=device)
