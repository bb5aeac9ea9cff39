"""The Triton side of ``test_triton_kernels.py``: runs every case's kernels in Triton's
interpreter and saves what they wrote.

Triton's interpreter must be on before Triton is first imported (its own library functions are
built then), and other tests import Triton through PyTorch, so the kernels run in a process of
their own: ``TRITON_INTERPRET=1 python -m triton_interpreted OUT``. The cases and their inputs
are defined here once, for both sides.
"""

import os
import sys

import torch

from commhooks.compress import blocks as quantize
from commhooks.compress import cpu_kernels, triton_launch
from commhooks.compress.blocks import BlockFormat

# Lengths past a program's tile (2048 elements; 1024 in the owner's pass): several programs.
OWNED = 2560
DECODED = 2500
QUANTIZE = [
    (bits, block, rows, keep)
    for bits in (8, 4)
    for block in (8, 40, 64)  # 40: a block narrower than its tile
    for rows in (1, 3)
    for keep in (True, False)
]
ADD = [
    (bits, added, keep) for bits in (8, 4) for added in (0, 1, 63, 1000, 1344) for keep in (1, 0)
]
DECODE = [(bits, rows) for bits in (8, 4) for rows in (1, 2, 3, 5)]
PARTIAL = [
    (bits, columns, dtype)
    for bits in (8, 4)
    for columns in (0, 1, 63, 65, 191)  # odd: a row ending mid-byte
    for dtype in ("float32", "bfloat16", "float16")
]
OWNER = [
    (bits, world, remembered, keep)
    for bits in (8, 4)
    for world in (1, 3, 4)
    for remembered in (None, 77, OWNED)
    for keep in (True, False)
]
BITS = (8, 4)
# The packed format's 13 levels (qmax 6): rows, and whether the error is kept; owners' worlds.
PACKED = [(rows, keep) for rows in (1, 3) for keep in (True, False)]
PACKED_OWNER = (1, 3)


def values(rows: int, length: int, seed: int) -> torch.Tensor:
    """Rows spanning 1e-40 to 1e30, with a block's worth of zeros, of subnormals, of -max and
    of equal values (where the block is 8)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, length, generator=gen)
    scale = torch.logspace(-40, 30, rows * length)[torch.randperm(rows * length, generator=gen)]
    x *= scale.view(rows, length)
    flat = x.view(-1)
    flat[:8], flat[8:16], flat[16:24] = 0.0, 1e-44, -torch.finfo(torch.float32).max
    flat[-8:] = 2.5
    return x


def quantize_input(bits: int, block: int, rows: int) -> tuple[BlockFormat, torch.Tensor]:
    fmt = BlockFormat(bits, block)
    length = fmt.row_length(rows * (2048 + 5), rows)  # past a tile at every block
    return fmt, values(rows, length, seed=bits + block + rows)


def add_input(bits: int, added: int) -> tuple[BlockFormat, torch.Tensor, tuple]:
    x = values(3, 448, seed=added)
    # halved, so that their sum stays finite where both hold -max
    first, second = (values(1, added, seed=seed).view(-1) / 2 for seed in (1, 2))
    return BlockFormat(bits, 64), x, (first, second)


def packets_of(fmt: BlockFormat, rows: int, length: int, seed: int, clamp: float = 0.0):
    """Eagerly quantized rows, to decode."""
    x = values(rows, length, seed)
    if clamp:
        x = x.clamp(-clamp, clamp)
    packets = torch.empty(rows, fmt.packet_bytes(length), dtype=torch.uint8)
    with cpu_kernels.disabled():
        quantize.quantize_(x, packets, fmt, torch.empty_like(x))
    return packets


def owner_input(bits: int, world: int, remembered: int | None):
    fmt = BlockFormat(bits, 64)
    memory = None
    if remembered is not None:
        memory = torch.randn(remembered, generator=torch.Generator().manual_seed(world))
    return fmt, packets_of(fmt, world, OWNED, seed=world, clamp=1e30), memory  # a finite sum


def non_finite_input() -> torch.Tensor:
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(3))
    x[0, 3], x[1, 40], x[1, 60], x[1, 61] = float("inf"), float("nan"), -float("inf"), 1.0
    return x


def _quantized(x, fmt, keep=True, add=None, **how):
    left = x.clone()
    packets = torch.full((x.shape[0], fmt.packet_bytes(x.shape[1])), 7, dtype=torch.uint8)
    assert triton_launch.quantize_rows(
        left, packets, fmt.bits, fmt.block, keep, add, qmax=fmt.qmax, **how
    )
    return packets, left


def _decoded(packets, fmt, out, **how):
    assert triton_launch.dequantize_rows(packets, fmt.bits, fmt.block, out, **how)
    return out


def _owner(packets, fmt, world, memory, keep, length=OWNED, **how):
    out = torch.full((1, length), 5.0)
    packet = torch.full((1, fmt.packet_bytes(length)), 7, dtype=torch.uint8)
    args = (packets, fmt.bits, fmt.block, world, out, packet, keep, memory)
    assert triton_launch.requantize_rows(*args, qmax=fmt.qmax, **how)
    return packet, out


def _refusals() -> list[bool]:
    """What the kernels say to layouts they cannot read (all must be False)."""
    q = triton_launch.quantize_rows
    d = triton_launch.dequantize_rows
    r = triton_launch.requantize_rows
    x = torch.randn(2, 32)
    packets = torch.zeros(2, BlockFormat(8, 8).packet_bytes(32), dtype=torch.uint8)
    size = packets.shape[1]
    unaligned = torch.zeros(2 * size + 1, dtype=torch.uint8)[1:].view(2, size)
    return [
        q(x.t().contiguous().t(), packets, 8, 8, True),  # rows not contiguous
        q(x.double(), packets, 8, 8, True),
        q(x.clone().requires_grad_(), packets, 8, 8, True),
        q(x, packets[:, :-4], 8, 8, True),  # packets too short
        q(x[:, :24], packets, 8, 8, True),  # rows of another length
        q(x, unaligned, 8, 8, True),  # scales not 4-byte aligned
        q(x, packets, 8, 8, True, (torch.ones(3), torch.ones(4))),  # addends of two lengths
        q(x, packets, 8, 4, True),  # a block of whole bytes at 4 bits: a multiple of 8
        d(packets, 8, 8, torch.empty(2, 32, dtype=torch.float64)),
        d(packets, 8, 8, torch.empty(1, 32).half(), add_rows=True),  # sums are float32
        r(packets, 8, 8, 0, torch.empty(1, 32), packets[:1], True),  # world 0
    ]


def run_all() -> dict[str, object]:
    """Every case's kernel outputs, by case."""
    results: dict[str, object] = {}
    for bits, block, rows, keep in QUANTIZE:
        fmt, x = quantize_input(bits, block, rows)
        results[f"quantize {bits} {block} {rows} {keep}"] = _quantized(x, fmt, keep)
    for bits, added, keep in ADD:
        fmt, x, add = add_input(bits, added)
        results[f"add {bits} {added} {keep}"] = _quantized(x, fmt, bool(keep), add)
    for bits, rows in DECODE:
        fmt = BlockFormat(bits, 64)
        length = fmt.row_length(rows * DECODED, rows)
        packets = packets_of(fmt, rows, length, seed=rows)
        decoded = _decoded(packets, fmt, torch.empty(rows, length))
        summed = _decoded(packets, fmt, torch.empty(1, length), add_rows=True)
        results[f"decode {bits} {rows}"] = (decoded, summed)
    for bits, columns, dtype in PARTIAL:
        fmt = BlockFormat(bits, 64)
        packets = packets_of(fmt, 2, 192, seed=columns, clamp=6e4)  # float16's range
        out = torch.full((2, columns), 5.0, dtype=getattr(torch, dtype))
        results[f"partial {bits} {columns} {dtype}"] = _decoded(packets, fmt, out, length=192)
    for bits, world, remembered, keep in OWNER:
        fmt, packets, memory = owner_input(bits, world, remembered)
        results[f"owner {bits} {world} {remembered} {keep}"] = _owner(
            packets, fmt, world, memory, keep
        )
    for bits in BITS:
        fmt = BlockFormat(bits, 16)
        packets, left = _quantized(non_finite_input(), fmt)
        results[f"non-finite {bits}"] = (packets, left, _owner(packets, fmt, 2, None, True, 64))
        fmt, x = BlockFormat(bits, 64), values(2, 256, seed=11)
        packets, left = _quantized(x, fmt, reciprocal=True)
        summed = _decoded(packets, fmt, torch.empty(1, 256), add_rows=True)
        owned = _owner(packets, fmt, 3, None, False, 256, reciprocal=True)
        results[f"reciprocal {bits}"] = (packets, left, summed, owned)
    packed = BlockFormat(4, 64, packed=True)
    for rows, keep in PACKED:
        x = quantize_input(4, 64, rows)[1]
        results[f"packed {rows} {keep}"] = _quantized(x, packed, keep)
    for world in PACKED_OWNER:
        packets = packets_of(packed, world, OWNED, seed=world, clamp=1e30)
        results[f"packed owner {world}"] = _owner(packets, packed, world, None, True)
    results["refusals"] = _refusals()
    return results


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    assert triton_launch.available(), "Triton is not installed"
    torch.save(run_all(), sys.argv[1])
