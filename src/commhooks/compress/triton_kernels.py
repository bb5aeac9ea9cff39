"""Triton kernels of block quantization, loaded by ``triton_launch`` (beside it) on first use.

Each program handles ``GROUP`` blocks of one row as a ``GROUP x WIDTH`` tile (``WIDTH``: the
block size rounded up to a power of two, masked beyond it) held in registers, so that every
pass reads and writes the bucket once: the error-feedback add, the block's absolute maximum,
the codes, the scale and the error all come from one tile.

The arithmetic is PyTorch's eager form on the tensors' device, operation for operation, so that
both paths give the same bits (``tests/test_triton_kernels.py`` holds the kernels to it):

* ``scale = absmax / qmax`` and ``mean = sum / world``: a correctly rounded division where
  PyTorch divides (its CPU operations, and so Triton's interpreter), a multiplication by the
  float32 reciprocal where it multiplies (``RECIPROCAL``: PyTorch's CUDA kernels divide by a
  host scalar that way);
* ``per_unit = (1 / absmax) * qmax``, ``level = rint(x * per_unit)`` (ties to even, through the
  float32 integer-rounding constant, exact below 2**22, where every level of a finite block
  lies);
* ``error = fma(-level, scale, x)`` and ``decoded = fma(nibble, scale, -8 * scale)`` (PyTorch's
  ``addcmul`` with ``value=1``, the scales negated for the error: one rounding on a CPU and on
  CUDA, where its kernel rounds the product first for any other ``value``),
  ``decoded = code * scale`` at 8 bits;
* a sum of decoded rows adds them in row order, after one rounding of ``first + second`` where
  an addition is asked for.

Launches pass ``enable_fp_fusion=False`` so that the compiler fuses no multiply-add but those
written. The absolute maximum compares ``|x|``'s bit patterns as integers: the same maximum for
finite values, and one at or above infinity's when a block holds inf or NaN, whose scale is then
not finite, as PyTorch's is.
"""

import os

import triton
import triton.language as tl


def interpreting() -> bool:
    """Whether Triton builds kernels for its interpreter now (``TRITON_INTERPRET``)."""
    knobs = getattr(triton, "knobs", None)  # Triton 3.4 and later
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


INTERPRETED = interpreting()  # how the kernels below were built

_SMALLEST_ABSMAX: tl.constexpr = tl.constexpr(1e-30)
_ROUNDER: tl.constexpr = tl.constexpr(12582912.0)  # 1.5 * 2**23: x + it - it is rint(x)
_MAGNITUDE: tl.constexpr = tl.constexpr(0x7FFFFFFF)


@triton.jit
def _tile(BLOCK: tl.constexpr, WIDTH: tl.constexpr, GROUP: tl.constexpr, blocks):
    """This program's blocks, each one's columns, and which of them lie in the row."""
    block = tl.program_id(0) * GROUP + tl.arange(0, GROUP)
    within = tl.arange(0, WIDTH)
    column = block[:, None] * BLOCK + within[None, :]
    inside = (block[:, None] < blocks) & (within[None, :] < BLOCK)
    return block, column, inside


@triton.jit
def _decode(
    codes,
    scales,
    row,
    block,
    inside,
    blocks,
    packet_stride,
    scale_stride,
    BLOCK: tl.constexpr,
    WIDTH: tl.constexpr,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
):
    """The decoded float32 tile of ``row``'s blocks (0 outside the row)."""
    step = tl.load(scales + row * scale_stride + block, mask=block < blocks, other=0.0)
    step = step[:, None]
    base = codes + row * packet_stride
    if BITS == 8:
        column = block[:, None] * BLOCK + tl.arange(0, WIDTH)[None, :]
        code = tl.load(base + column, mask=inside, other=0)
        return code.to(tl.float32) * step
    pair, pair_inside = _pairs(block, blocks, BLOCK, WIDTH)
    packed = tl.load(base + pair, mask=pair_inside, other=0)
    nibbles = tl.reshape(tl.join(packed & 15, packed >> 4), [GROUP, WIDTH])
    value = tl.fma(nibbles.to(tl.float32), step, step * -8.0)
    return tl.where(inside, value, 0.0)  # a missing nibble would decode to -8 steps


@triton.jit
def _pairs(block, blocks, BLOCK: tl.constexpr, WIDTH: tl.constexpr):
    """The bytes of a 4-bit tile (two elements each), and which of them lie in the row
    (written from ranges, not from the elements' mask, so that they load and store as
    vectors)."""
    half = tl.arange(0, WIDTH // 2)
    pair = block[:, None] * (BLOCK // 2) + half[None, :]
    return pair, (block[:, None] < blocks) & (half[None, :] < BLOCK // 2)


@triton.jit
def _quantize(
    x,
    codes,
    scales,
    row,
    block,
    column,
    inside,
    packet_stride,
    scale_stride,
    blocks,
    qmax,
    inv_qmax,
    BLOCK: tl.constexpr,
    WIDTH: tl.constexpr,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    RECIPROCAL: tl.constexpr,
):
    """Write the codes and scales of tile ``x`` (0 outside the row); return its error."""
    magnitude = x.to(tl.int32, bitcast=True) & _MAGNITUDE
    absmax = tl.max(magnitude, axis=1).to(tl.float32, bitcast=True)
    absmax = tl.where(absmax < _SMALLEST_ABSMAX, _SMALLEST_ABSMAX, absmax)
    step = absmax * inv_qmax if RECIPROCAL else tl.math.div_rn(absmax, qmax)
    per_unit = tl.math.div_rn(1.0, absmax) * qmax
    level = (x * per_unit[:, None] + _ROUNDER) - _ROUNDER
    # A non-finite block's levels may be NaN, which has no integer: 0 (never decoded).
    level = tl.where((level >= -qmax) & (level <= qmax), level, 0.0)
    tl.store(scales + row * scale_stride + block, step, mask=block < blocks)
    base = codes + row * packet_stride
    whole = level.to(tl.int32)
    if BITS == 8:
        tl.store(base + column, whole.to(tl.int8), mask=inside)
    else:
        low, high = tl.split(tl.reshape(whole + 8, [GROUP, WIDTH // 2, 2]))
        pair, pair_inside = _pairs(block, blocks, BLOCK, WIDTH)
        tl.store(base + pair, (low | (high << 4)).to(tl.uint8), mask=pair_inside)
    return tl.fma(-level, step[:, None], x)


@triton.jit
def quantize_kernel(
    x_ptr,
    x_stride,
    codes,
    scales,
    packet_stride,
    scale_stride,
    first,
    second,
    added,
    length,
    blocks,
    qmax,
    inv_qmax,
    BLOCK: tl.constexpr,
    WIDTH: tl.constexpr,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    KEEP: tl.constexpr,
    ADD: tl.constexpr,
    RECIPROCAL: tl.constexpr,
):
    """Quantize a row's blocks, after ``x = first + second`` on the first ``added`` elements
    (row-major); leave the error (``KEEP``) or the sum in ``x``."""
    row = tl.program_id(1).to(tl.int64)
    block, column, inside = _tile(BLOCK, WIDTH, GROUP, blocks)
    at = x_ptr + row * x_stride + column
    if ADD:
        flat = row * length + column
        summed = inside & (flat < added)
        x = tl.load(at, mask=inside & (flat >= added), other=0.0)
        addend = tl.load(first + flat, mask=summed, other=0.0)
        x = tl.where(summed, addend + tl.load(second + flat, mask=summed, other=0.0), x)
    else:
        x = tl.load(at, mask=inside, other=0.0)
    error = _quantize(
        x, codes, scales, row, block, column, inside, packet_stride, scale_stride, blocks,
        qmax, inv_qmax, BLOCK, WIDTH, GROUP, BITS, RECIPROCAL,
    )  # fmt: skip
    if KEEP:
        tl.store(at, error, mask=inside)
    elif ADD:
        tl.store(at, x, mask=summed)


@triton.jit
def decode_kernel(
    codes,
    scales,
    packet_stride,
    scale_stride,
    out,
    out_stride,
    rows,
    columns,
    blocks,
    BLOCK: tl.constexpr,
    WIDTH: tl.constexpr,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    SUM: tl.constexpr,
    BFLOAT16: tl.constexpr,
):
    """Decode the first ``columns`` elements of each row into ``out``'s rows, or (``SUM``)
    their sum in row order into its one row."""
    row = tl.program_id(1).to(tl.int64)
    block, column, inside = _tile(BLOCK, WIDTH, GROUP, blocks)
    value = _decode(
        codes, scales, row, block, inside, blocks, packet_stride, scale_stride,
        BLOCK, WIDTH, GROUP, BITS,
    )  # fmt: skip
    if SUM:
        for other in range(1, rows):
            value += _decode(
                codes, scales, other, block, inside, blocks, packet_stride, scale_stride,
                BLOCK, WIDTH, GROUP, BITS,
            )  # fmt: skip
    # bfloat16 as int16 bits; float16 rounded once to nearest, ties to even
    value = _bfloat16_bits(value) if BFLOAT16 else value.to(out.dtype.element_ty)
    tl.store(out + row * out_stride + column, value, mask=inside & (column < columns))


@triton.jit
def _bfloat16_bits(value):
    """``value`` rounded to bfloat16 (to nearest, ties to even; NaN to 0x7FC0), as PyTorch
    rounds it, returned as its bits; written out in integers, which round alike everywhere."""
    bits = value.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(value != value, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def requantize_kernel(
    codes,
    scales,
    packet_stride,
    scale_stride,
    rows,
    out,
    own_codes,
    own_scales,
    memory,
    remembered,
    blocks,
    world,
    inv_world,
    qmax,
    inv_qmax,
    BLOCK: tl.constexpr,
    WIDTH: tl.constexpr,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    KEEP: tl.constexpr,
    MEMORY: tl.constexpr,
    RECIPROCAL: tl.constexpr,
):
    """The owner's pass: the decoded rows' sum over ``world``, plus ``memory`` on its first
    ``remembered`` elements, quantized into one packet; the error (``KEEP``) or the value
    quantized into ``out``."""
    block, column, inside = _tile(BLOCK, WIDTH, GROUP, blocks)
    total = _decode(
        codes, scales, 0, block, inside, blocks, packet_stride, scale_stride,
        BLOCK, WIDTH, GROUP, BITS,
    )  # fmt: skip
    for other in range(1, rows):
        total += _decode(
            codes, scales, other, block, inside, blocks, packet_stride, scale_stride,
            BLOCK, WIDTH, GROUP, BITS,
        )  # fmt: skip
    x = total * inv_world if RECIPROCAL else tl.math.div_rn(total, world)
    if MEMORY:
        kept = inside & (column < remembered)
        x = tl.where(kept, x + tl.load(memory + column, mask=kept, other=0.0), x)
    error = _quantize(
        x, own_codes, own_scales, 0, block, column, inside, 0, 0, blocks,
        qmax, inv_qmax, BLOCK, WIDTH, GROUP, BITS, RECIPROCAL,
    )  # fmt: skip
    tl.store(out + column, error if KEEP else x, mask=inside)
