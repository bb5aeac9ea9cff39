"""How a bucket is laid out in rows, one a rank, and the buffers it reuses from step to step.

A bucket's parameters are laid out by their stable numbers, so the same parameters make the same
rows whatever order DDP hands them in; the memories are keyed by those numbers, or for a part of
a parameter (a two-hop share's) by the elements of the parameter it holds.
"""

import dataclasses
import functools
import itertools
import operator
import weakref
from typing import Any

import torch

from commhooks.compress import blocks, cpu_kernels
from commhooks.compress.error_feedback import Key, all_finite
from commhooks.hooks._bucket import GradBucket
from commhooks.hooks.quantized.options import OWNER

__all__ = [
    "BucketLayout",
    "Wire",
    "Workspace",
    "bucket_keys",
    "checked_key",
    "checked_piece",
    "describe_key",
    "key_number",
    "piece_sizes",
]

_referent = weakref.ref.__call__  # a weak reference's object, as a C function for map()


@dataclasses.dataclass(frozen=True)
class BucketLayout:
    """Where each parameter of a bucket goes, and how the bucket is cut into one row per rank.

    Laid out by number, whatever their order in the bucket (DDP's first step and a fresh DDP
    after a restart hand them over in another order), the same parameters make the same blocks
    and rows, so a restart resumes bit for bit.

    Attributes:
        numbers: the parameters' stable numbers (:mod:`commhooks.numbering`), ascending.
        keys: the first memory's key of each: its number, or for a part of a parameter (a
            two-hop share's) ``"number:first-stop"``, the elements of the parameter it holds.
        offsets: where each parameter starts in the rows (as one flat tensor).
        sizes: each parameter's element count.
        sources: each parameter's offset in the bucket's buffer.
        numel: the bucket's length.
        length: elements per row, whole blocks; the rows together are the bucket zero-padded.
        pieces: this rank's row, as ``(key, start, stop)``: the parts of parameters it holds,
            keyed ``"number:first-stop"`` (the owner's memory's keys), at ``[start, stop)``.
        piece_sources: where each piece's first element lies in the bucket's buffer.
    """

    numbers: tuple[int, ...]
    keys: tuple[Key, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    sources: tuple[int, ...]
    numel: int
    length: int
    pieces: tuple[tuple[str, int, int], ...]
    piece_sources: tuple[int, ...]

    @functools.cached_property
    def piece_keys(self) -> tuple[str, ...]:
        """The keys of :attr:`pieces`, in order."""
        return tuple(key for key, _, _ in self.pieces)

    @functools.cached_property
    def in_order(self) -> bool:
        """Whether the rows hold the buffer as it is (the bucket's order is the layout's)."""
        return self.sources == self.offsets

    @staticmethod
    def build(
        keys: tuple[Key, ...], sizes: tuple[int, ...], length: int, rank: int
    ) -> "BucketLayout":
        """The layout of a bucket holding the parameters (or parts) ``keys`` of ``sizes``, in
        that order."""
        numbers = tuple(key_number(key) for key in keys)
        firsts = tuple(0 if isinstance(key, int) else _parse_piece_key(key)[1] for key in keys)
        order = sorted(range(len(numbers)), key=numbers.__getitem__)
        in_buffer = _starts(sizes)
        sizes = tuple(sizes[i] for i in order)
        offsets = _starts(sizes)
        row_start, row_stop = rank * length, (rank + 1) * length
        pieces, piece_sources = [], []
        for i, offset, size in zip(order, offsets, sizes):
            start, stop = max(offset, row_start), min(offset + size, row_stop)
            if start < stop:  # keyed by the elements of the parameter, not of a part
                first = firsts[i] - offset
                key = piece_key(numbers[i], start + first, stop + first)
                pieces.append((key, start - row_start, stop - row_start))
                piece_sources.append(in_buffer[i] + start - offset)
        return BucketLayout(
            tuple(numbers[i] for i in order),
            tuple(keys[i] for i in order),
            offsets,
            sizes,
            tuple(in_buffer[i] for i in order),
            sum(sizes),
            length,
            tuple(pieces),
            tuple(piece_sources),
        )

    def places(self) -> list[tuple[int, int, int, int]]:
        """``(number, offset, size, source)`` of each parameter, in the layout's order."""
        return list(zip(self.numbers, self.offsets, self.sizes, self.sources))


def _starts(sizes: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(itertools.accumulate(sizes[:-1], initial=0)) if sizes else ()


def piece_key(number: int, first: int, stop: int) -> str:
    """The key of elements ``[first, stop)`` of parameter ``number`` in the second memory."""
    return f"{number}:{first}-{stop}"


def key_number(key: Key) -> int:
    """The number of the parameter a memory's key is of."""
    return key if isinstance(key, int) else _parse_piece_key(key)[0]


def _parse_piece_key(key: str) -> tuple[int, int, int]:
    number, _, span = key.partition(":")
    first, _, stop = span.partition("-")
    parsed = int(number), int(first), int(stop)
    if min(parsed) < 0 or parsed[1] >= parsed[2]:
        raise ValueError(f"{key!r} is not 'number:first-stop' with first < stop")
    return parsed


def describe_key(key: Key) -> str:
    if isinstance(key, str):
        number, first, stop = _parse_piece_key(key)
        return f"elements {first}-{stop - 1} of parameter #{number}"
    return f"parameter #{key} (counted from DDP's last parameter, 0 being the last)"


class _Side:
    """One of a workspace's two error buffers: the rows (the compensated gradient, then its
    error) and this rank's averaged row (then its error), with views of each parameter and
    piece made once (slicing at every step costs host time per bucket)."""

    def __init__(self, both: torch.Tensor, layout: BucketLayout) -> None:
        self.both = both  # the rows, then this rank's row: one tensor, kept or not at once
        self.rows, self.mine = both[:-1], both[-1:]
        flat = self.rows.view(-1)
        self.params = tuple(flat[o : o + n] for o, n in zip(layout.offsets, layout.sizes))
        self.pieces = tuple(self.mine[0, start:stop] for _, start, stop in layout.pieces)
        self.bucket = flat[: layout.numel]  # the rows' elements of the bucket, in order
        # On a CPU, the kernels' calls bound to this side's buffers (see bind_kernels).
        self.quantize: cpu_kernels.BoundQuantize | None = None
        self.owner: tuple[cpu_kernels.BoundDequantize, cpu_kernels.BoundQuantize] | None = None
        self.keep_other: cpu_kernels.BoundDequantize | None = None

    def bind_kernels(self, work: "Workspace", fmt: blocks.BlockFormat, other: "_Side") -> None:
        """Bind the CPU kernels' calls to this side's buffers and ``work``'s packets, checked
        once here rather than at every call (about 3 us a call): the rank's quantization, the
        owner's pass and, with error feedback (``other``, the other side), the copy of ``other``
        over this side where the gathered scales are not finite."""
        bits, block, qmax, keep = fmt.bits, fmt.block, fmt.qmax, other is not self
        self.quantize = cpu_kernels.bound_quantize(self.rows, work.send, bits, block, keep, qmax)
        summed = cpu_kernels.bound_dequantize(work.received, bits, block, self.mine, add_rows=True)
        owned = cpu_kernels.bound_quantize(self.mine, work.own_packet, bits, block, keep, qmax)
        self.owner = (summed, owned) if summed is not None and owned is not None else None
        if keep:
            self.keep_other = cpu_kernels.bound_keep_if_not_finite(
                work.gathered, bits, block, work.layout.length, self.both, other.both
            )

    def keep_unless_finite(self, other: "_Side", scales: torch.Tensor) -> None:
        """Where the step's gathered ``scales`` are not all finite, this side takes ``other``'s
        values (the memories before the step), with nothing read back."""
        if self.keep_other is None or not self.keep_other():
            torch.where(all_finite(scales), self.both, other.both, out=self.both)


class Wire:
    """The packets of a packed format as they travel (:mod:`commhooks.compress.packing`):
    ``send``/``received`` for the all-to-all, ``own``/``gathered`` for the all-gather."""

    def __init__(self, world: int, size: int, device: torch.device) -> None:
        def packets(rows: int) -> torch.Tensor:
            return torch.empty(rows, size, dtype=torch.uint8, device=device)

        self.send, self.received = packets(world), packets(world)
        self.own, self.gathered = packets(1), packets(world)


class Workspace:
    """The buffers one bucket reuses from step to step (allocating them costs page faults).

    ``now`` is the side written this step (:class:`_Side`), ``kept`` the one holding the
    memories where the last step left them (without error feedback, the same); ``levels`` is
    scratch; ``send``/``received``, ``own_packet``/``gathered`` the exchanges' packets (with
    one rank, the same tensors), ``wire`` what they travel as when packed. Set each step by
    :meth:`QuantizationState.begin`: ``addition``, ``first`` and ``second`` (the generators).
    """

    def __init__(
        self,
        layout: BucketLayout,
        fmt: blocks.BlockFormat,
        world: int,
        device: torch.device,
        error_feedback: bool,
    ) -> None:
        self.layout, self.device, self.world = layout, device, world
        self.alone = world == 1  # one rank: the exchanges are then the packets themselves
        self.order = layout.keys  # the memories' keys; in the bucket's order once bound
        # The parameters themselves, in that order, held weakly (see serves).
        self.params: tuple[weakref.ref[torch.Tensor], ...] = ()
        length, packet = layout.length, fmt.packet_bytes(layout.length)

        def floats(rows: int) -> torch.Tensor:
            # Zeros: the padding past the bucket's end must quantize to nothing.
            return torch.zeros(rows, length, device=device)

        def packets(rows: int) -> torch.Tensor:
            return torch.empty(rows, packet, dtype=torch.uint8, device=device)

        self.levels = floats(world)
        self.now = _Side(floats(world + 1), layout)
        self.kept = _Side(floats(world + 1), layout) if error_feedback else self.now
        self.send, self.own_packet = packets(world), packets(1)
        self.received = self.send if world == 1 else packets(world)
        self.gathered = self.own_packet if world == 1 else packets(world)
        self.scales = fmt.split(self.gathered, length)[1]  # of the gathered rows
        packed = fmt.packed and world > 1
        self.wire = Wire(world, fmt.wire_bytes(length), device) if packed else None
        self.addition: tuple[torch.Tensor, torch.Tensor] | None = None
        self.first: torch.Generator | None = None
        self.second: torch.Generator | None = None
        # A step began on these buffers and has not committed (abandoned, or not finite: its
        # padding may hold NaN, see clear_padding).
        self.unfinished = False
        self.fmt = fmt  # the block format the buffers were made for
        self._decoding: tuple[tuple[int, torch.dtype], list[cpu_kernels.BoundDequantize]] | None
        self._decoding = None
        if device.type == "cpu":  # the kernels' calls bound once (a GPU's are Triton's)
            self.now.bind_kernels(self, fmt, self.kept)
            if error_feedback:
                self.kept.bind_kernels(self, fmt, self.now)

    @property
    def rows(self) -> torch.Tensor:
        """The rows quantized this step (then their error)."""
        return self.now.rows

    def serves(self, params: list[torch.Tensor], buffer: torch.Tensor) -> bool:
        """Whether ``params`` are the parameters of this workspace's last step, in its order,
        and ``buffer`` holds them on its device (then their gradients tiled it already):
        compared without a Python call per parameter, which a GPU's host pays per bucket."""
        known = self.params
        return (
            len(known) == len(params)
            and all(map(operator.is_, map(_referent, known), params))
            and self.layout.numel == buffer.numel()
            and self.device == buffer.device
        )

    def fits(self, layout: BucketLayout, world: int, device: torch.device) -> bool:
        """Whether these buffers serve ``layout`` (the same rows, in any bucket order)."""
        same_rows = (self.layout.keys, self.layout.sizes) == (layout.keys, layout.sizes)
        same_place = self.layout.pieces == layout.pieces and self.world == world
        same_length = self.layout.length == layout.length
        return same_rows and same_place and same_length and self.device == device

    def decode_kernels(self, buffer: torch.Tensor) -> list[cpu_kernels.BoundDequantize] | None:
        """The CPU kernels' calls that decode the gathered rows straight into ``buffer`` (the
        bucket's, in the layout's order), bound at its first use and again if the bucket
        moves; ``None`` where the kernels cannot take them."""
        if self.device.type != "cpu":
            return None
        key = (buffer.data_ptr(), buffer.dtype)
        if self._decoding is None or self._decoding[0] != key:
            fmt, length = self.fmt, self.layout.length
            calls = [
                cpu_kernels.bound_dequantize(part, fmt.bits, fmt.block, target, length=length)
                for part, target, _ in blocks.decode_parts(self.gathered, buffer, self.levels)
            ]
            bound = [call for call in calls if call is not None]
            self._decoding = (key, bound if len(bound) == len(calls) else [])
        return self._decoding[1] or None

    def swap(self) -> None:
        """Make the side written this step the kept one (its errors are the memories now)."""
        self.now, self.kept = self.kept, self.now

    def clear_padding(self) -> None:
        """Zero the rows past the bucket's end, which a step that never committed (abandoned,
        or not finite) may have left inf or NaN in (a finite step leaves zeros there)."""
        self.now.rows.view(-1)[self.layout.numel :].zero_()


def checked_key(name: str) -> Key:
    """A first memory's key: a parameter's number, or a part's ``"number:first-stop"``."""
    return int(name) if name.strip().isdigit() else checked_piece(name)


def bucket_keys(numbers: tuple[int, ...], bucket: "GradBucket | Any") -> tuple[Key, ...]:
    """The first memory's keys of a bucket's gradients: each parameter's number, or where the
    bucket holds parts of parameters (``bucket.parts()``, a two-hop share) the part's."""
    held = getattr(bucket, "parts", None)
    parts = held() if callable(held) else None
    if parts is None:
        return numbers
    return tuple(n if p is None else piece_key(n, *p) for n, p in zip(numbers, parts))


def checked_piece(name: str) -> str:
    """A loaded second memory's key, as saved (``ValueError`` unless ``"number:first-stop"``)."""
    _parse_piece_key(name)
    return name


def piece_sizes(gradients: list[torch.Tensor], buffer: torch.Tensor) -> tuple[int, ...]:
    """How many elements of ``buffer`` belong to each parameter's gradient: its own in DDP's
    buckets; in an FSDP2 shard, which pads each parameter's rows, up to the next gradient's.

    Raises:
        ValueError: the gradients are not consecutive views that cover ``buffer``.
    """
    sizes = tuple(g.numel() for g in gradients)
    if sum(sizes) == buffer.numel():
        return sizes
    base = buffer.storage_offset()
    starts = [int(g.storage_offset() - base) for g in gradients]
    shared = all(
        g.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr() for g in gradients
    )
    ends = [*starts[1:], int(buffer.numel())]
    pieces = tuple(end - start for start, end in zip(starts, ends))
    if not shared or not starts or starts[0] != 0 or any(p < n for p, n in zip(pieces, sizes)):
        raise ValueError(
            f"{OWNER}: the bucket's gradients hold {sum(sizes)} elements but its buffer "
            f"{buffer.numel()}; a bucket handed to the hook must be laid out as DDP's: "
            "gradients() are consecutive views into buffer(), in order, that cover it."
        )
    return pieces
