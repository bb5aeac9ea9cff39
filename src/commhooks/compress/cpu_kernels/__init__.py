"""Fused CPU kernels in plain C, built on first use and loaded with ctypes, for the quantization
math (:mod:`commhooks.compress.blocks`) and the bf16 hook.

PyTorch's eager form reads and writes a bucket six times to quantize it with a scale a block
and keep the error; ``_blockquant.c`` reads and writes it once. ``_bfloat16.c`` casts and
divides in one pass, ``_base13.c`` packs 13-level 4-bit codes in one pass where PyTorch takes
a dozen; ``_parallel.c`` runs their parts on threads. All give PyTorch's bits
(``tests/test_kernels.py``). The system's C compiler builds them in about a second, once per
machine and source, into a cache directory.

Where there is no compiler, the tensors are not the plain CPU layout the kernels read, or
``COMMHOOKS_NATIVE=0`` is set, callers get ``False`` (or ``None``) and run the eager form: the
choice changes a result's speed, never its bits.

Environment:
    COMMHOOKS_NATIVE: ``0`` to never build or load the kernels.
    COMMHOOKS_CACHE_DIR: where built kernels are kept (default ``$XDG_CACHE_HOME/commhooks``,
        else ``~/.cache/commhooks``).
    CC: the C compiler (default ``cc``, else ``gcc``, else ``clang``).
"""

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import torch

from commhooks._loader import KernelLoader

__all__ = [
    "Addends",
    "BoundDequantize",
    "BoundQuantize",
    "available",
    "bound_dequantize",
    "bound_keep_if_not_finite",
    "bound_quantize",
    "bfloat16_scaled",
    "dequantize_rows",
    "disabled",
    "pack13",
    "quantize_rows",
    "unpack13",
]

logger = logging.getLogger(__name__)

_SOURCES = ("_parallel.c", "_blockquant.c", "_bfloat16.c", "_base13.c")  # one library
_HEADERS = ("_parallel.h",)
# -ffp-contract=off: no fused multiply-add but the ones written (PyTorch's bits); no
# -ffast-math, which would reorder sums. -march=native: the build is keyed by this CPU's flags.
_FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared")
_TUNINGS = (("-march=native",), ())  # the first that builds is kept
_BUILD_SECONDS = 120
# One thread per this many elements at least: below it, starting a thread costs more than it
# saves.
_ELEMENTS_PER_THREAD = 1 << 18


_P, _I64, _INT, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


def available() -> bool:
    """Whether the fused kernels are built and loaded (building them on the first call)."""
    return _LOADER.get() is not None


def disabled() -> contextlib.AbstractContextManager[None]:
    """Run the eager form in every thread while the block is active (for comparisons)."""
    return _LOADER.disabled()


def quantize_rows(
    x: torch.Tensor,
    packets: torch.Tensor,
    bits: int,
    block: int,
    keep: bool,
    add: tuple[torch.Tensor, torch.Tensor] | None = None,
    qmax: int | None = None,
) -> bool:
    """Quantize the rows of ``x`` into ``packets`` as ``quantize.quantize_`` with nearest
    rounding does (``add`` included), codes in ``[-qmax, qmax]`` (by default the widest
    ``bits`` hold); ``False`` (nothing done) where the kernels cannot take these tensors."""
    qmax = (1 << (bits - 1)) - 1 if qmax is None else qmax
    head = _quantize_head(x, packets, bits, block, keep, qmax)
    if head is None or (add is not None and not _addends_fit(x, *add)):
        return False
    library = _LOADER.get()
    if library is None:
        return False
    first, second, n = (
        (None, None, 0) if add is None else (*(t.data_ptr() for t in add), add[0].numel())
    )
    library.commhooks_quantize(*head, first, second, n, _threads(x.numel()))
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
    """Decode ``packets`` (rows of ``length`` elements, by default ``out``'s) into the rows of
    ``out`` as ``quantize.dequantize_`` does, or their sum in row order into its one row with
    ``add_rows``; ``out`` may hold fewer columns than ``length``: the rows' first elements.
    ``False`` (nothing done) where the kernels cannot take these tensors."""
    args = _dequantize_args(packets, bits, block, out, length, add_rows)
    library = None if args is None else _LOADER.get()
    if args is None or library is None:
        return False
    library.commhooks_dequantize(*args)
    return True


# A call bound to its tensors (:func:`bound_quantize`, :func:`bound_dequantize`): ``True``
# once done, ``False`` (nothing done) where the kernels are off or cannot take the addends.
Addends = tuple[torch.Tensor, torch.Tensor] | None
BoundQuantize = Callable[[Addends], bool]
BoundDequantize = Callable[[], bool]


def bound_quantize(
    x: torch.Tensor, packets: torch.Tensor, bits: int, block: int, keep: bool, qmax: int
) -> BoundQuantize | None:
    """:func:`quantize_rows` of these tensors, checked now, not at each call (about 3 us a
    bucket): for a workspace's buffers, kept from step to step. The call takes ``add``, checked
    when it is not the pair the last call took; it returns ``False`` while the kernels are off.
    ``None`` where they cannot take the tensors. The arguments wait in one array the kernel
    reads through one pointer (ctypes converts each argument, 0.25 us apiece)."""
    head = _quantize_head(x, packets, bits, block, keep, qmax)
    library = None if head is None else _LOADER.get()
    if head is None or library is None:
        return None
    args = (ctypes.c_int64 * 14)(*head, 0, 0, 0, _threads(x.numel()))
    quantize, at = library.commhooks_quantize_packed, ctypes.addressof(args)  # args: held below
    # The last addends that fit, held (so that their ids stay theirs), with where they were and
    # their lengths then: the same tensors, still there and as long, are not checked again.
    fitted: list[object] = []

    def call(add: Addends) -> bool:
        if _LOADER.off:  # turned off (loaded, since bound): the eager form instead
            return False
        if add is None:
            args[12] = 0  # nothing added
            quantize(at)
            return True
        first, second = add
        where = (first.data_ptr(), second.data_ptr(), first.numel(), second.numel())
        if not (fitted and first is fitted[0] and second is fitted[1] and where == fitted[2]):
            if not _addends_fit(x, first, second):
                return False
            fitted[:] = (first, second, where)
        args[10], args[11], args[12] = where[0], where[1], where[2]
        quantize(at)
        return True

    return call


def bound_dequantize(
    packets: torch.Tensor,
    bits: int,
    block: int,
    out: torch.Tensor,
    *,
    length: int | None = None,
    add_rows: bool = False,
) -> BoundDequantize | None:
    """:func:`dequantize_rows` of these tensors, checked now (see :func:`bound_quantize`)."""
    found = _dequantize_args(packets, bits, block, out, length, add_rows)
    library = None if found is None else _LOADER.get()
    if found is None or library is None:
        return None
    args = (ctypes.c_int64 * len(found))(*found)
    dequantize, at = library.commhooks_dequantize_packed, ctypes.addressof(args)

    def call(_held: ctypes.Array[ctypes.c_int64] = args) -> bool:  # holds the array alive
        if _LOADER.off:
            return False
        dequantize(at)
        return True

    return call


def bound_keep_if_not_finite(
    packets: torch.Tensor, bits: int, block: int, length: int, now: torch.Tensor, kept: torch.Tensor
) -> BoundDequantize | None:
    """A bound call (see :func:`bound_quantize`) that copies ``kept`` over ``now`` (float32) if
    a scale of ``packets`` (rows of ``length``) is inf or NaN: a quantized step's memories kept
    where its result is not finite, in one pass over the scales."""
    rows = packets.shape[0]
    found = _packets_fit(packets, rows, length, bits, block)
    n = now.numel()
    fits = all(_flat(t, torch.float32, n) for t in (now, kept))
    library = None if found is None or not fits else _LOADER.get()
    if found is None or library is None:
        return None
    at, stride = found
    scales, blocks = length * bits // 8, length // block
    keep = library.commhooks_keep_if_not_finite
    pointers = (now.data_ptr(), kept.data_ptr())

    def call() -> bool:
        if _LOADER.off:
            return False
        keep(at, stride, rows, scales, blocks, *pointers, n)
        return True

    return call


# The quantizing kernel's arguments but the addition and the threads; the decoding kernel's.
_Head = tuple[int, ...]


def _quantize_head(
    x: torch.Tensor, packets: torch.Tensor, bits: int, block: int, keep: bool, qmax: int
) -> _Head | None:
    """The quantizing kernel's arguments up to the addition, or ``None``."""
    rows, length = x.shape
    rows_at, packets_at = _plain_rows(x, torch.float32, rows, length), None
    if rows_at is not None:
        packets_at = _packets_fit(packets, rows, length, bits, block)
    if rows_at is None or packets_at is None:
        return None
    return (*rows_at, rows, length, block, bits, qmax, *packets_at, int(keep))


def _dequantize_args(
    packets: torch.Tensor,
    bits: int,
    block: int,
    out: torch.Tensor,
    length: int | None,
    add_rows: bool,
) -> _Head | None:
    """The decoding kernel's arguments, or ``None``."""
    rows, columns = packets.shape[0], out.shape[-1]
    length = columns if length is None else length
    if out.dim() != 2 or not 0 <= columns <= length:
        return None
    out_at, packets_at = _plain_rows(out, torch.float32, 1 if add_rows else rows, columns), None
    if out_at is not None:
        packets_at = _packets_fit(packets, rows, length, bits, block)
    if out_at is None or packets_at is None:
        return None
    return (
        *packets_at, rows, length, columns, block, bits, *out_at, int(add_rows),
        _threads(rows * columns),
    )  # fmt: skip


def bfloat16_scaled(x: torch.Tensor, out: torch.Tensor, world: int) -> bool:
    """``out.copy_(x).div_(world)`` (bfloat16 ``out``) in one pass; whether it was done."""
    n = x.numel()
    if world < 1 or not (_flat(x, torch.float32, n) and _flat(out, torch.bfloat16, n)):
        return False
    library = _LOADER.get()
    if library is None:
        return False
    # Multiplying by 1 / world is the division's bits where that is exact: a power of two.
    divide = world & (world - 1) != 0
    factor = float(world) if divide else 1.0 / world
    library.commhooks_bf16_scale_down(
        x.data_ptr(), out.data_ptr(), n, factor, int(divide), _threads(n)
    )
    return True


def pack13(nibbles: torch.Tensor, out: torch.Tensor) -> bool:
    """``packing.pack13_``; whether it was done."""
    return _base13("commhooks_pack13", nibbles, out, 16, 15)


def unpack13(packed: torch.Tensor, nibbles: torch.Tensor) -> bool:
    """``packing.unpack13_``; whether it was done."""
    return _base13("commhooks_unpack13", packed, nibbles, 15, 16)


def _base13(name: str, source: torch.Tensor, target: torch.Tensor, size: int, out: int) -> bool:
    """Run packing kernel ``name`` from ``source`` (``size`` bytes a quad) into ``target``."""
    rows, columns = source.shape
    quads = columns // size
    source_at = _plain_rows(source, torch.uint8, rows, columns, aligned=False)
    target_at = _plain_rows(target, torch.uint8, rows, quads * out, aligned=False)
    if columns % size or source_at is None or target_at is None:
        return False
    library = _LOADER.get()
    if library is None:
        return False
    getattr(library, name)(source_at[0], source_at[1], target_at[0], target_at[1], rows, quads)
    return True


def _flat(t: torch.Tensor, dtype: torch.dtype, numel: int) -> bool:
    """A contiguous CPU tensor of ``dtype`` and ``numel`` elements, aligned for its dtype."""
    return (
        t.device.type == "cpu"
        and t.dtype == dtype
        and t.layout == torch.strided
        and t.numel() == numel
        and t.is_contiguous()
        and not t.requires_grad
        and t.data_ptr() % t.element_size() == 0
    )


_Rows = tuple[int, int]  # where a tensor starts and its row stride, read once a call


def _packets_fit(
    packets: torch.Tensor, rows: int, length: int, bits: int, block: int
) -> _Rows | None:
    """uint8 rows of whole even blocks, scales 4-byte aligned: where and their stride."""
    if bits not in (4, 8) or block % 2 or length % block:
        return None
    size = length * bits // 8 + 4 * (length // block)
    found = _plain_rows(packets, torch.uint8, rows, size)
    return found if found is not None and found[1] % 4 == 0 else None


def _plain_rows(
    t: torch.Tensor, dtype: torch.dtype, rows: int, length: int, *, aligned: bool = True
) -> _Rows | None:
    """``rows x length`` of ``dtype`` on the CPU, 4-byte aligned (if ``aligned``), each row
    contiguous, none overlapping: where it starts and its row stride, else ``None``."""
    if t.dtype != dtype or not t.is_cpu or t.requires_grad or t.shape != (rows, length):
        return None
    at = t.data_ptr()
    if t.is_contiguous():  # the usual tensor: rows of ``length`` one after another
        return (at, length) if at % 4 == 0 or not aligned else None
    row_stride, column_stride = t.stride()
    if (
        (column_stride == 1 or length <= 1)
        and row_stride >= length
        and (at % 4 == 0 or not aligned)
    ):
        return at, row_stride
    return None


def _addends_fit(x: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> bool:
    """Two contiguous CPU float32 tensors of one length, at most ``x``'s, ``x`` contiguous."""
    n = first.numel()
    return (
        x.is_contiguous()
        and n <= x.numel()
        and all(_flat(t, torch.float32, n) for t in (first, second))
    )


def _threads(elements: int) -> int:
    if elements < 2 * _ELEMENTS_PER_THREAD:  # most calls: one thread, without asking torch
        return 1
    return max(1, min(torch.get_num_threads(), elements // _ELEMENTS_PER_THREAD))


def _load() -> ctypes.CDLL | None:
    if os.environ.get("COMMHOOKS_NATIVE", "1").strip() == "0":
        logger.info("COMMHOOKS_NATIVE=0: PyTorch's eager operations run instead of the kernels")
        return None
    try:
        library = _opened()
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        logger.info("PyTorch's eager operations run instead of the kernels (%s)", error)
        return None
    library.commhooks_quantize.argtypes = [
        *(_P, _I64, _I64, _I64, _I64, _INT, _INT, _P, _I64, _INT),
        *(_P, _P, _I64, _INT),
    ]
    library.commhooks_dequantize.argtypes = [
        *(_P, _I64, _I64, _I64, _I64, _I64, _INT),
        *(_P, _I64, _INT, _INT),
    ]
    library.commhooks_quantize.restype = library.commhooks_dequantize.restype = None
    for packed in (library.commhooks_quantize_packed, library.commhooks_dequantize_packed):
        packed.argtypes, packed.restype = [_P], None  # the arguments' array (see bound_*)
    library.commhooks_keep_if_not_finite.argtypes = [_P, _I64, _I64, _I64, _I64, _P, _P, _I64]
    library.commhooks_keep_if_not_finite.restype = None
    library.commhooks_bf16_scale_down.argtypes = [_P, _P, _I64, _F32, _INT, _INT]
    library.commhooks_bf16_scale_down.restype = None
    for packing in (library.commhooks_pack13, library.commhooks_unpack13):
        packing.argtypes = [_P, _I64, _P, _I64, _I64, _I64]
        packing.restype = None
    return library


def _opened() -> ctypes.CDLL:
    """The built kernels, loaded; a cached file the loader refuses is built again, once."""
    try:
        return ctypes.CDLL(str(_built()))
    except OSError as error:
        logger.info("building the fused kernels again (%s)", error)
        return ctypes.CDLL(str(_built(again=True)))


def _built(again: bool = False) -> Path:
    """The built kernels for these sources, compiler and CPU, built if new (or ``again``)."""
    compiler = _compiler()
    package = resources.files(__name__)
    sources = [package.joinpath(name).read_bytes() for name in _SOURCES + _HEADERS]
    key = hashlib.sha256(
        b"\0".join([*sources, compiler.encode(), " ".join(_FLAGS).encode(), _machine().encode()])
    ).hexdigest()[:20]
    directory = _cache_dir()
    target = directory / f"kernels-{key}.so"
    if target.exists() and not again:
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        for name, source in zip(_SOURCES + _HEADERS, sources, strict=True):
            (Path(scratch) / name).write_bytes(source)
        built = Path(scratch) / "built.so"
        _compile(compiler, [Path(scratch) / name for name in _SOURCES], built)
        os.replace(built, target)  # atomic: a rank building beside this one finds either file
    logger.info("built the fused kernels into %s", target)
    return target


def _compile(compiler: str, sources: list[Path], out: Path) -> None:
    errors = []
    files = [str(source) for source in sources]
    for tuning in _TUNINGS:
        command = [compiler, *_FLAGS, *tuning, "-pthread", *files, "-o", str(out), "-lm"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=_BUILD_SECONDS)
        if done.returncode == 0:
            return
        errors.append(done.stderr.strip().splitlines()[-1:] or ["failed"])
    raise RuntimeError(f"{compiler} could not build {', '.join(_SOURCES)}: {errors[-1][0]}")


def _compiler() -> str:
    named = os.environ.get("CC")
    for candidate in [named] if named else ["cc", "gcc", "clang"]:
        found = shutil.which(candidate)
        if found:
            return found
    raise RuntimeError("no C compiler (cc, gcc or clang) on PATH; set CC to one")


def _machine() -> str:
    """What a build compiled for this CPU depends on: architecture and instruction sets."""
    flags = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    return f"{platform.system()} {platform.machine()} {flags}"


def _cache_dir() -> Path:
    named = os.environ.get("COMMHOOKS_CACHE_DIR")
    if named:
        return Path(named)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "commhooks"


# The kernels' library, loaded on first use.
_LOADER: KernelLoader[ctypes.CDLL] = KernelLoader(_load)
