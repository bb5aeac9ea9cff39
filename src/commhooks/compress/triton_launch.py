"""Block quantization on GPUs in Triton kernels, for :mod:`commhooks.compress.blocks`.

Each kernel of ``triton_kernels.py`` does one of the eager form's passes (quantize; decode; the
owner's decode, sum, divide, add and quantize) in one launch, reading and writing the bucket
once, with the eager form's bits (``tests/test_triton_kernels.py``, through Triton's
interpreter; ``examples/quantize_passes.py --device cuda --check`` on a GPU).

Triton is imported on the first CUDA tensor, so that ``import commhooks`` stays light. Where
it is missing, ``COMMHOOKS_TRITON=0`` is set, or the tensors are not the plain layout the
kernels read, the functions return ``False`` and the caller runs the eager form. With
``TRITON_INTERPRET=1`` set before Triton's import, the kernels run on CPU tensors instead.

Environment:
    COMMHOOKS_TRITON: ``0`` to never load the kernels.
"""

import contextlib
import importlib
import logging
import math
import os
import re
from types import ModuleType

import numpy as np
import torch

from commhooks._loader import KernelLoader

__all__ = [
    "available",
    "dequantize_rows",
    "disabled",
    "quantize_rows",
    "requantize_rows",
]

logger = logging.getLogger(__name__)

# Elements a program holds (a tile of whole blocks): enough to keep loads wide and in flight,
# few enough to stay in registers (16 a thread with 4 warps). The owner's pass covers one row,
# a rank's share of the bucket, with smaller tiles, so that its grid still fills the GPU.
_TILE, _OWNER_TILE = 2048, 1024
_WARPS = 4  # a program's warps: 16 elements a thread in a whole tile
# Before 3.6, Triton's correctly rounded division flushed subnormal results to zero (1 / x for
# |x| > 2**126), which PyTorch's does not.
_OLDEST_TRITON = (3, 6)
_MAX_ROWS = 65535  # the grid's second dimension
_MAX_ELEMENTS = 1 << 31  # offsets within a row of rows are 32-bit in the kernels
# What a decoded row may be written as: float32, or rounded once from it, as PyTorch does.
_DECODED = (torch.float32, torch.bfloat16, torch.float16)


def available() -> bool:
    """Whether the kernels are loaded (loading them, and so Triton, on the first call)."""
    return _LOADER.get() is not None


def disabled() -> contextlib.AbstractContextManager[None]:
    """Run the eager form in the whole process while the block is active (for comparisons)."""
    return _LOADER.disabled()


def quantize_rows(
    x: torch.Tensor,
    packets: torch.Tensor,
    bits: int,
    block: int,
    keep: bool,
    add: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    qmax: int | None = None,
    reciprocal: bool | None = None,
) -> bool:
    """``blocks.quantize_`` with nearest rounding on ``x``'s device; whether it was done.

    Args:
        qmax: the largest code magnitude (by default the widest ``bits`` hold).
        reciprocal: divide by ``qmax`` as a multiplication by its float32 reciprocal (as
            PyTorch's CUDA kernels do), not a division (its CPU kernels'); by default, as on
            ``x``'s device.
    """
    rows, length = x.shape
    kernels = _LOADER.get()
    if kernels is None or not _packets_fit(kernels, packets, rows, length, bits, block):
        return False
    if not _rows_fit(kernels, x, rows, length):
        return False
    if add is not None and not _addends_fit(kernels, x, *add):
        return False
    codes, scales = _split(packets, length, bits)
    first, second = (x, x) if add is None else add  # (unread without ADD)
    width, group, grid = _shape(block, length, rows)
    with _on(x):
        kernels.quantize_kernel[grid](
            x, x.stride(0), codes, scales, packets.stride(0), scales.stride(0),
            first, second, 0 if add is None else add[0].numel(), length, length // block,
            *_qmax(bits, qmax),
            BLOCK=block, WIDTH=width, GROUP=group, BITS=bits, KEEP=keep, ADD=add is not None,
            RECIPROCAL=_reciprocal(x, reciprocal), num_warps=_WARPS, enable_fp_fusion=False,
        )  # fmt: skip
    return True


def dequantize_rows(
    packets: torch.Tensor,
    bits: int,
    block: int,
    out: torch.Tensor,
    *,
    length: int | None = None,
    add_rows: bool = False,
) -> bool:
    """``blocks.dequantize_`` into ``out`` (float32, bfloat16 or float16), or with ``add_rows``
    the rows' sum in row order into its one float32 row; whether it was done."""
    rows, columns = packets.shape[0], out.shape[-1]
    length = columns if length is None else length
    kernels = _LOADER.get()
    if kernels is None or out.dim() != 2 or not 0 <= columns <= length:
        return False
    if not _packets_fit(kernels, packets, rows, length, bits, block):
        return False
    dtypes = (torch.float32,) if add_rows else _DECODED
    if not _rows_fit(kernels, out, 1 if add_rows else rows, columns, dtypes):
        return False
    if columns == 0:
        return True
    codes, scales = _split(packets, length, bits)
    width, group, grid = _shape(block, columns, 1 if add_rows else rows)
    bfloat16 = out.dtype == torch.bfloat16
    target = out.view(torch.int16) if bfloat16 else out
    with _on(out):
        kernels.decode_kernel[grid](
            codes, scales, packets.stride(0), scales.stride(0), target, out.stride(0),
            rows, columns, math.ceil(columns / block),
            BLOCK=block, WIDTH=width, GROUP=group, BITS=bits, SUM=add_rows, BFLOAT16=bfloat16,
            num_warps=_WARPS, enable_fp_fusion=False,
        )  # fmt: skip
    return True


def requantize_rows(
    packets: torch.Tensor,
    bits: int,
    block: int,
    world: int,
    out: torch.Tensor,
    packet: torch.Tensor,
    keep: bool,
    memory: torch.Tensor | None = None,
    *,
    qmax: int | None = None,
    reciprocal: bool | None = None,
) -> bool:
    """The owner's pass of ``blocks.requantize_sum_``; whether it was done. ``qmax`` and
    ``reciprocal`` as for :func:`quantize_rows` (the division by ``world`` too)."""
    rows, length = packets.shape[0], out.shape[-1]
    kernels = _LOADER.get()
    if kernels is None or world < 1 or out.dim() != 2:
        return False
    if not (
        _packets_fit(kernels, packets, rows, length, bits, block)
        and _packets_fit(kernels, packet, 1, length, bits, block)
        and _rows_fit(kernels, out, 1, length)
    ):
        return False
    if memory is not None and not _addends_fit(kernels, out, memory, memory):
        return False
    codes, scales = _split(packets, length, bits)
    own_codes, own_scales = _split(packet, length, bits)
    width, group, grid = _shape(block, length, 1, _OWNER_TILE)
    inverse = float(np.float32(1.0) / np.float32(world))
    with _on(out):
        kernels.requantize_kernel[grid](
            codes, scales, packets.stride(0), scales.stride(0), rows, out, own_codes, own_scales,
            out if memory is None else memory, 0 if memory is None else memory.numel(),
            length // block, float(world), inverse, *_qmax(bits, qmax),
            BLOCK=block, WIDTH=width, GROUP=group, BITS=bits, KEEP=keep,
            MEMORY=memory is not None, RECIPROCAL=_reciprocal(out, reciprocal), num_warps=_WARPS,
            enable_fp_fusion=False,
        )  # fmt: skip
    return True


def _split(packets: torch.Tensor, length: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes (int8 at 8 bits, packed uint8 at 4) and the float32 scales of ``packets``."""
    payload = length * bits // 8
    codes = packets[:, :payload]
    return codes.view(torch.int8) if bits == 8 else codes, packets[:, payload:].view(torch.float32)


def _shape(
    block: int, columns: int, rows: int, tile: int = _TILE
) -> tuple[int, int, tuple[int, int]]:
    """The tile's width (the block to a power of two), blocks a program, and the grid."""
    width = 1 << (block - 1).bit_length()
    group = max(1, tile // width)
    return width, group, (max(1, math.ceil(columns / (block * group))), rows)


def _qmax(bits: int, qmax: int | None) -> tuple[float, float]:
    """``qmax`` (default: the widest ``bits`` hold) and its float32 reciprocal, as PyTorch's."""
    largest = (1 << (bits - 1)) - 1 if qmax is None else qmax
    return float(largest), float(np.float32(1.0) / np.float32(largest))


# The checks below run at every launch, several a bucket, on the host's path while the GPU
# works: they read ``is_cuda``/``is_cpu`` and ``get_device()`` rather than ``t.device``, whose
# object costs the host a quarter of a microsecond each time it is made.


def _reciprocal(t: torch.Tensor, asked: bool | None) -> bool:
    return t.is_cuda if asked is None else asked


def _on(t: torch.Tensor) -> contextlib.AbstractContextManager[None]:
    """``t``'s CUDA device made current: Triton launches on the current one."""
    if not t.is_cuda:
        return contextlib.nullcontext()
    index = t.get_device()
    if index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(index)


def _packets_fit(
    kernels: ModuleType, packets: torch.Tensor, rows: int, length: int, bits: int, block: int
) -> bool:
    """uint8 rows of whole blocks (of 8 elements or more), scales 4-byte aligned."""
    size = length * bits // 8 + 4 * (length // block)
    return (
        bits in (4, 8)
        and block % 8 == 0
        and length % block == 0
        and 0 < rows <= _MAX_ROWS
        and packets.dtype == torch.uint8
        and _plain_rows(kernels, packets, rows, size)
        and packets.stride(0) % 4 == 0
    )


def _rows_fit(
    kernels: ModuleType,
    x: torch.Tensor,
    rows: int,
    length: int,
    dtypes: tuple[torch.dtype, ...] = (torch.float32,),
) -> bool:
    return 0 < rows <= _MAX_ROWS and x.dtype in dtypes and _plain_rows(kernels, x, rows, length)


def _plain_rows(kernels: ModuleType, t: torch.Tensor, rows: int, length: int) -> bool:
    """``rows x length`` on the kernels' device, 4-byte aligned, rows contiguous, apart."""
    if not _on_kernels_device(kernels, t) or t.shape != (rows, length) or t.requires_grad:
        return False
    row_stride, column_stride = t.stride()
    return (
        (column_stride == 1 or length <= 1)
        and length <= row_stride
        and rows * row_stride < _MAX_ELEMENTS
        and t.data_ptr() % 4 == 0
    )


def _addends_fit(kernels: ModuleType, x: torch.Tensor, *addends: torch.Tensor) -> bool:
    """Contiguous float32 tensors of one length, at most ``x``'s, ``x`` contiguous."""
    n = addends[0].numel()
    return (
        x.is_contiguous()
        and n <= x.numel()
        and all(
            _on_kernels_device(kernels, t)
            and t.get_device() == x.get_device()
            and t.dtype == torch.float32
            and t.is_contiguous()
            and not t.requires_grad
            and t.numel() == n
            and t.data_ptr() % 4 == 0
            for t in addends
        )
    )


def _on_kernels_device(kernels: ModuleType, t: torch.Tensor) -> bool:
    """CUDA tensors; CPU tensors instead where the kernels run in Triton's interpreter."""
    return t.is_cpu if kernels.INTERPRETED else t.is_cuda


def _load() -> ModuleType | None:
    if os.environ.get("COMMHOOKS_TRITON", "1").strip() == "0":
        logger.info("COMMHOOKS_TRITON=0: PyTorch's eager operations run instead of Triton's")
        return None
    try:
        import triton
    except ImportError as error:
        logger.info("PyTorch's eager operations run instead of Triton's (%s)", error)
        return None
    found = tuple(int(part) for part in re.findall(r"\d+", triton.__version__)[:2])
    if found < _OLDEST_TRITON:
        logger.info(
            "Triton %s is older than %s, whose division flushes subnormal results to zero, "
            "unlike PyTorch's: PyTorch's eager operations run instead (pip install -U triton)",
            triton.__version__, ".".join(map(str, _OLDEST_TRITON)),
        )  # fmt: skip
        return None
    return importlib.import_module("commhooks.compress.triton_kernels")


# The Triton kernels' module, loaded on first use.
_LOADER: KernelLoader[ModuleType] = KernelLoader(_load)
