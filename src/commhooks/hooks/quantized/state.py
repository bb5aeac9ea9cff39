"""Options, memory and per-bucket bookkeeping of the quantized hook.

Public through :mod:`commhooks` and :mod:`commhooks.hooks.quantized`; the hook that uses them
is :mod:`commhooks.hooks.quantized.hook`.
"""

import dataclasses
import functools
import itertools
import operator
import threading
import weakref
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from commhooks import comm, handshake, place
from commhooks._warnings import warn_once
from commhooks.compress import blocks, cpu_kernels
from commhooks.compress.error_feedback import ErrorFeedback, Key, all_finite
from commhooks.hooks._bucket import GradBucket
from commhooks.numbering import ParameterNumbering
from commhooks.options import Options, flag, integer, nonfinite_option, one_of, option
from commhooks.state import HookState, StateDictError, check_count, check_tensor

__all__ = ["BucketLayout", "QuantizationOptions", "QuantizationState", "Wire", "Workspace"]

OWNER = "QuantizationState"
HOOK = "quantized_hook"  # the name the handshake reports for the hook using this state
_referent = weakref.ref.__call__  # a weak reference's object, as a C function for map()
_PHASES = (0, 1)  # the two quantizations: a rank's own gradient, the average of its row


AUTO, FLAT = "auto", "flat"


def _check_topology(owner: str, name: str, value: Any) -> "str | comm.Topology":
    if isinstance(value, str) and value in (AUTO, FLAT):
        return value
    try:
        found = comm.Topology.of(value)
    except ValueError as exc:
        raise ValueError(f"{owner}: {name}: {exc}") from None
    if found is not None:
        return found
    raise ValueError(
        f"{owner}: {name} must be 'auto' (two hops where the group spans machines of several "
        "ranks each), 'flat' (one exchange over every rank), a commhooks.Topology, its rank "
        "lists (one list of global ranks per machine: [[0, 1], [2, 3]]) or a 2-D DeviceMesh "
        f"of shape (machines, ranks within a machine); got {name}={value!r}."
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizationOptions(Options):
    """The options of :class:`QuantizationState`, each checked when the state is built."""

    owner: ClassVar[str] = OWNER

    bits: int = option(
        8,
        "bits per element on the wire: 8 sends about a quarter of float32's bytes, 4 about an "
        "eighth with steps 18 times coarser",
        check=one_of(8, 4, hint="8 or 4"),
    )
    block_size: int = option(
        256,
        "elements sharing one float32 scale: smaller blocks follow the gradient's range more "
        "closely and send more scales (4 bytes a block)",
        check=integer(8, 1 << 20, hint="a multiple of 8, e.g. 128 or 256"),
    )
    packed: bool = option(
        False,
        "4 bits only: send codes of 13 levels packed eight to 30 bits, so that with 256-value "
        "blocks a value and its share of the scale take 3.875 bits on the wire, not 4.125 "
        "(steps 7/6 as coarse; error feedback sends what they leave out later)",
        check=flag(),
    )
    rounding: str = option(
        blocks.NEAREST,
        "'nearest' has the smallest error; 'stochastic' is unbiased, for use without error "
        "feedback",
        check=one_of(*blocks.ROUNDINGS),
    )
    error_feedback: bool = option(
        True,
        "remember what quantization dropped and add it to the next gradient, so that over steps "
        "nothing is lost (one float32 copy of the gradients, and a share of one per rank)",
        check=flag(strict=False),
    )
    warmup_steps: int = option(
        0, "average in full precision for this many steps first", check=integer(0)
    )
    random_seed: int = option(
        0,
        "seed of stochastic rounding (each rank's generators add its place in the exchange)",
        check=integer(0, 2**62),
    )
    on_nonfinite: str = nonfinite_option()
    topology: "str | comm.Topology" = option(
        AUTO,
        "'auto' sums within each machine first and sends only the machine's share across "
        "machines where the group spans two or more machines of two or more ranks each; "
        "'flat' exchanges over every rank; or the machines, as a commhooks.Topology or a 2-D "
        "DeviceMesh (machines, ranks within a machine)",
        check=_check_topology,
    )

    def check_together(self) -> None:
        if self.packed and (self.bits != 4 or self.block_size % 32):
            raise ValueError(
                f"{self.owner}: packed=True packs 4-bit codes 32 at a time: use bits=4 and a "
                f"block_size that is a multiple of 32 (e.g. 256), or packed=False; got "
                f"bits={self.bits}, block_size={self.block_size}."
            )
        if isinstance(self.topology, comm.Topology) and not self.topology.even:
            raise ValueError(
                f"{self.owner}: topology {self.topology.describe()} holds unequal numbers of "
                "ranks a machine, which a two-hop average cannot split evenly; give machines of "
                "equal size, or topology='flat'."
            )
        if self.block_size % 8:
            raise ValueError(
                f"{self.owner}: block_size must be a multiple of 8 (a block of 4-bit codes fills "
                f"whole bytes and its scale stays aligned), e.g. {self.block_size // 8 * 8 or 8}; "
                f"got block_size={self.block_size}."
            )

    @property
    def format(self) -> blocks.BlockFormat:
        """The block format these options describe (one object per format: asked several
        times a bucket, and a frozen dataclass costs the host a microsecond to make)."""
        return _format(self.bits, self.block_size, self.packed)


@functools.cache
def _format(bits: int, block: int, packed: bool) -> blocks.BlockFormat:
    return blocks.BlockFormat(bits, block, packed)


_OPTION_NAMES = frozenset(QuantizationOptions.names())  # read-only attributes of the state


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


def _describe(key: Key) -> str:
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


class QuantizationState(HookState):
    """Options and error memories of :func:`~commhooks.hooks.quantized.hook.quantized_hook`.

    Build it as ``QuantizationState(process_group, bits, **options)`` (e.g.
    ``QuantizationState(None, 4, block_size=128)``; ``None``: the default group), the options
    those of :class:`QuantizationOptions`, refused with the fix (``ValueError``) when out of
    range. Each reads as a read-only attribute (``state.bits``); ``state.settings`` is all.

    Two error memories, both :class:`~commhooks.compress.error_feedback.ErrorFeedback`:

    * ``error``: what this rank's quantization dropped from its own gradient, a float32 tensor
      per parameter keyed by its number, so it follows the parameter through DDP's rebuilds
      (on two hops, a part of a parameter in this rank's share by its elements,
      ``"number:first-stop"``: dropped where a rebuild or restart cuts the share otherwise).
    * ``owner_error``: what the second quantization dropped from the average of the row this
      rank owns, keyed by the elements it covers (``"number:first-stop"``). A piece owned
      differently after a rebuild or restart is dropped (at most half a quantization step of
      the average); the others carry over.
    """

    kind = "quantization"
    version = 1
    _transient = (
        "_numbering",
        "_layouts",
        "_workspaces",
        "issuer",
        "_pool",
        "_checked",
        "_reloaded",
        "_generators",
        "_world",
        "_rank",
        "_committing",
        "hops",
        "hop_issuers",
        "shares",
        "_shape",
    )

    def __init__(
        self, process_group: dist.ProcessGroup | None = None, bits: int = 8, **options: Any
    ) -> None:
        super().__init__(process_group)
        self.settings = QuantizationOptions.from_mapping({"bits": bits, **options})
        self.iter = 0
        self.error, self.owner_error = self._memory(), self._memory()
        self._saved_place: dict[str, Any] | None = None  # where a loaded dict was saved
        self._generator_states: torch.Tensor | None = None  # loaded, not yet in use
        self._restore_transient()

    def _restore_transient(self) -> None:
        self._numbering = ParameterNumbering()
        self._layouts: dict[tuple[tuple[Key, ...], tuple[int, ...]], BucketLayout] = {}
        self._workspaces: dict[int, Workspace] = {}
        self.issuer: comm.OrderedIssuer | None = None
        self._pool: comm.IssuerPool | None = None  # see share_issuers
        self._checked: dist.ProcessGroup | None = None
        self._reloaded: str | None = None  # how a load mid-run changed the handshake's fields
        self._generators: list[torch.Generator] = []
        self._world, self._rank = 1, 0  # the checked group's, set by prepare()
        self.hops: comm.TwoHops | None = None  # the groups of a two-hop average, if any
        self.hop_issuers: comm.HopIssuers | None = None  # and the issuers of its follow-ups
        self.shares: dict[int, Any] = {}  # by bucket index: this rank's share of a two-hop
        self._shape = FLAT  # words for the path taken (saved with the place)
        self._committing = threading.Lock()
        self.error.check_before_use()  # unpickled memories are checked as loaded ones are
        self.owner_error.check_before_use()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        if self._generators:  # the generators are dropped; their states travel instead
            state["_generator_states"] = torch.stack([g.get_state() for g in self._generators])
        return state

    def __getattr__(self, name: str) -> Any:
        if name != "settings" and name in _OPTION_NAMES:
            return getattr(self.settings, name)
        raise AttributeError(f"'{OWNER}' object has no attribute '{name}'")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OPTION_NAMES:
            raise AttributeError(
                f"{OWNER}.{name} is read-only: the ranks must agree on it, and the memories were "
                f"made with it. Build a new QuantizationState(..., {name}={value!r}) instead."
            )
        super().__setattr__(name, value)

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self.settings.as_dict().items())
        return f"{OWNER}({options}, iter={self.iter})"

    # -- used by the hook, on DDP's thread ----------------------------------------------------
    def prepare(self) -> dist.ProcessGroup:
        """The group to use; on first use (and after ``bind``), check the ranks agree: a
        collective (:mod:`commhooks.handshake`, and the follow-up group of :attr:`issuer`) the
        hook makes at its first bucket, the same point on every rank."""
        group = comm.resolve_group(self.process_group, owner=OWNER)
        if self._checked is not group:
            handshake.agree(group, HOOK, self, self._reloaded)
            self._reloaded = None
            self._on(group)
        if self._saved_place is not None:  # the first step after a load
            self._forget_if_moved(self._place_here(group))
        return group

    def _on(self, group: dist.ProcessGroup) -> None:
        """Set up on ``group``: the path (two hops where the topology allows), its issuers,
        and fresh workspaces."""
        topology = self._two_hop_topology(group)
        self.hops, self.hop_issuers, self.issuer = None, None, None
        if topology is not None:  # each hop's group has an issuer of its own
            pool = self._pool if self._pool is not None else comm.IssuerPool()
            self.hops, self.hop_issuers = pool.two_hops(group, topology)
            self._world, self._rank = self.hops.nnodes, self.hops.machine
            comm.crosses_machines(self.hops.peers)
            comm.crosses_machines(self.hops.peers_follow)
        else:
            if self._pool is not None:
                self.issuer = self._pool.issuer(group)
            else:
                self.issuer = comm.OrderedIssuer(comm.follow_up_group(group))
            if self._spans_machines(group):  # the exchange, and the gather that follows it
                comm.crosses_machines(group)
                comm.crosses_machines(self.issuer.group)
            self._world, self._rank = comm.world_size(group), comm.group_rank(group)
        self._layouts.clear()
        self._workspaces.clear()
        self.shares.clear()
        self._checked = group

    def _spans_machines(self, group: dist.ProcessGroup) -> bool:
        """Whether the flat path's ``group`` holds ranks of several machines (the topology
        given, or found: one blocking gather at the first step, shared with the two-hop
        choice)."""
        if comm.world_size(group) < 2:
            return False
        chosen = self.settings.topology
        topology = chosen if isinstance(chosen, comm.Topology) else comm.topology_of(group)
        return topology.nnodes > 1

    def _two_hop_topology(self, group: dist.ProcessGroup) -> comm.Topology | None:
        """The topology of a two-hop average over ``group``, or ``None`` for the flat path."""
        chosen = self.settings.topology
        self._shape = FLAT
        if isinstance(chosen, comm.Topology):  # a topology of other ranks is a mistake anywhere
            chosen.check_covers(comm.global_ranks(group), OWNER)
        if chosen == FLAT or comm.world_size(group) < 3:  # two ranks: never uneven, one hop
            return None
        topology = chosen if isinstance(chosen, comm.Topology) else comm.topology_of(group)
        if not topology.two_hops():
            if not topology.even:
                warn_once(
                    f"quantization-uneven-{topology.machines}",
                    f"{OWNER}: the group's machines hold unequal numbers of ranks "
                    f"({topology.describe()}), which a two-hop average cannot split evenly; "
                    "the flat path is taken. Give machines of equal size (or say "
                    "topology='flat' to keep this path without this warning).",
                )
            return None
        self._shape = f"{topology.describe()}, two hops"
        return topology

    def _place_here(self, group: dist.ProcessGroup) -> dict[str, Any]:
        """This rank's place: its rank and world size in ``group``, the mesh's coordinates,
        and the path's shape (a memory of the two-hop path is a share of a machine's)."""
        here = {"world_size": comm.world_size(group), "rank": comm.group_rank(group)}
        return {**here, **self.mesh_place, "topology": self._shape}

    def share_issuers(self, pool: comm.IssuerPool | None) -> None:
        """Take the follow-ups' issuer from ``pool`` (``None``: an issuer of its own) at the
        next first use or new group: states whose averages one thread starts one after another
        (an averager's fragments) share one follow-up group. Not pickled: shared again after."""
        self._pool = pool

    def handshake_fields(self) -> dict[str, Any]:
        """What every rank must agree on at the first step: the options and the step count
        (ranks resumed at different steps would leave the warm-up at different steps)."""
        return {**self.settings.as_dict(), "iter": self.iter}

    def compressing(self, is_last: bool) -> bool:
        """Whether this step is past the warm-up; counts a step on its last bucket."""
        compressing = self.iter >= self.settings.warmup_steps
        if is_last:
            self.iter += 1
        return compressing

    def begin(self, bucket: GradBucket, buffer: torch.Tensor, last: bool) -> Workspace | None:
        """:meth:`workspace` of a bucket past the warm-up; ``None`` for a step averaged plainly
        (the warm-up) or an empty bucket. Counts the step on the last bucket, and numbers the
        parameters from the first, warm-up or not (:meth:`number`)."""
        if not self.compressing(last) or buffer.numel() == 0:
            self.number(bucket.parameters())  # (a compressing step's workspace numbers them)
            return None
        return self.workspace(bucket, buffer)

    def number(self, params: list[torch.Tensor]) -> tuple[int, ...]:
        """The parameters' stable numbers (the memories' keys), numbering new ones. Called from
        the first step on, warm-up included: numbered in DDP's first buckets, as after a
        restart, rather than in the buckets it rebuilds once the warm-up has begun."""
        return self._numbering.numbers(params)

    def workspace(self, bucket: "GradBucket | Any", buffer: torch.Tensor) -> Workspace:
        """The bucket's :class:`Workspace` for this step, after :meth:`prepare`: its rows
        compensated (or :attr:`Workspace.addition`), the step's generators, and after a load the
        loaded memories checked against the gradient. ``ValueError`` if the bucket's gradients
        do not tile its buffer."""
        work = self._workspaces.get(bucket.index())
        if work is None or not work.serves(bucket.parameters(), buffer):
            work = self._workspace(bucket, buffer)
        if work.unfinished:  # the last step on these buffers never committed
            work.clear_padding()
        work.unfinished = True
        if self.settings.rounding == blocks.STOCHASTIC:  # (nearest rounding draws nothing)
            work.first, work.second = self._generators_on(buffer.device)
        if self.error.awaits_check or self.owner_error.awaits_check:  # after a load only
            self._check_loaded(work.order, bucket, buffer, work.layout)
        work.addition = self._compensate(work, buffer)
        return work

    def _workspace(self, bucket: "GradBucket | Any", buffer: torch.Tensor) -> Workspace:
        """The buffers of ``bucket`` where last step's do not serve it: laid out again for the
        same parameters in another order, made again for another layout or device."""
        params = bucket.parameters()
        found = self._workspaces.get(bucket.index())
        keys = _keys(self._numbering.numbers(params), bucket)
        layout = self._layout(keys, _piece_sizes(bucket.gradients(), buffer))
        if found is None or not found.fits(layout, self._world, buffer.device):
            settings = self.settings
            found = Workspace(
                layout, settings.format, self._world, buffer.device, settings.error_feedback
            )
            self._workspaces[bucket.index()] = found
        found.layout, found.order = layout, keys
        found.params = tuple(weakref.ref(p) for p in params)
        return found

    def _layout(self, keys: tuple[Key, ...], sizes: tuple[int, ...]) -> BucketLayout:
        """The layout of a bucket holding parameters (or parts) ``keys`` of ``sizes``, made
        once."""
        found = self._layouts.get((keys, sizes))
        if found is None:
            length = self.settings.format.row_length(sum(sizes), self._world)
            found = BucketLayout.build(keys, sizes, length, self._rank)
            self._drop_stale_pieces(found)
            self._layouts[(keys, sizes)] = found
        return found

    def _generators_on(self, device: torch.device) -> tuple[torch.Generator, torch.Generator]:
        """The random numbers of stochastic rounding: one generator per quantization (a rank's
        own gradient, on DDP's thread; the average of its row, in the issuer's order), so that
        each is drawn from in the same order in every run, seeded ``random_seed + 2 rank + i``.
        """
        if not self._generators or self._generators[0].device != device:
            self._generators = [torch.Generator(device=device) for _ in _PHASES]
            states, self._generator_states = self._generator_states, None
            if states is None or not self._resumed(states, device):
                for i, made in enumerate(self._generators):
                    made.manual_seed(self.settings.random_seed + 2 * self._rank + i)
        return self._generators[0], self._generators[1]

    def _resumed(self, states: torch.Tensor, device: torch.device) -> bool:
        """Whether the loaded generator states were set: another device's (a CUDA run's on a
        CPU) give way to fresh seeds, with a warning, rather than fail in the backward."""
        try:
            for made, saved in zip(self._generators, states):
                made.set_state(saved.clone())
            return True
        except RuntimeError:
            warn_once(
                f"quantization-generators-{device.type}",
                f"{OWNER}: the loaded 'generators' are the states of another device's generators "
                f"({states.shape[1]} bytes each), not {device.type}'s; stochastic rounding starts "
                "again from its seeds.",
            )
            return False

    def _compensate(
        self, work: Workspace, buffer: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Fill ``work.rows`` with the gradient plus each remembered error, or return the two
        tensors the quantizing pass adds into them (the usual step: one pass). Out of place:
        the bucket keeps the plain gradient, which a re-send needs."""
        layout = work.layout
        if not self.settings.error_feedback:
            if layout.in_order:
                work.now.bucket.copy_(buffer)
            else:
                _scatter(buffer, layout, work.now.params, None)
            return None
        kept = work.kept
        if layout.in_order and self.error.holds(layout.keys, kept.params):
            return buffer, kept.bucket  # the last step's errors, where it left them
        found = [self.error.get(k, v) for k, v in zip(layout.keys, kept.params)]
        _gather(found, kept.params)  # the kept side holds the memories, should the step fail
        if layout.in_order:
            return buffer, kept.bucket
        _scatter(buffer, layout, work.now.params, list(kept.params))
        return None

    def owner_memory(self, work: Workspace) -> torch.Tensor | None:
        """The owner's remembered error of this rank's row, as a row (zeros where there is
        none) for the owner's pass to add, in the step's turn; ``None`` without error feedback
        or pieces."""
        pieces = work.layout.pieces
        if not self.settings.error_feedback or not pieces:
            return None
        memory, keys, kept = self.owner_error, work.layout.piece_keys, work.kept.pieces
        if not memory.holds(keys, kept):  # not where the last step left them
            _gather([memory.get(key, v) for key, v in zip(keys, kept)], kept)
        return work.kept.mine  # zeros past the pieces, as the rows' padding leaves them

    # -- used by the hook, once the step's result is known --------------------------------------
    def commit(self, work: Workspace) -> None:
        """Keep the errors this step left in ``work`` as the memories; swap the buffers.

        Where a gathered scale is inf or NaN the memories stay as before the step, decided on
        the device. Callbacks of several buckets (gloo's threads) commit one at a time.
        """
        work.unfinished = False
        if not self.settings.error_feedback:
            return
        now = work.now
        now.keep_unless_finite(work.kept, work.scales)
        layout = work.layout
        with self._committing:
            self.error.record_all(layout.keys, now.params)
            self.owner_error.record_all(layout.piece_keys, now.pieces)
            work.swap()

    # -- internal -------------------------------------------------------------------------------
    def _memory(self) -> ErrorFeedback:
        """An empty error memory; what it loads is checked against this format's residuals."""
        return ErrorFeedback(OWNER, _describe, self.settings.format.plausible_residual)

    def _check_loaded(
        self,
        keys: tuple[Key, ...],
        bucket: "GradBucket | Any",
        buffer: torch.Tensor,
        layout: BucketLayout,
    ) -> None:
        """At the first step after a load, compare each loaded error with this rank's gradient
        of its elements (for an owner's piece, of the scale of the average it is added to).
        Errors that met no gradient in that step are dropped at the next, under DDP.
        """
        if self.meets_every_tensor_each_step:
            self.error.forget_unmet(self.iter)
            self.owner_error.forget_unmet(self.iter)
        for key, gradient in zip(keys, bucket.gradients()):
            self.error.check_loaded_(key, gradient)
        for (key, start, stop), source in zip(layout.pieces, layout.piece_sources):
            self.owner_error.check_loaded_(key, buffer[source : source + stop - start])

    def _drop_stale_pieces(self, layout: BucketLayout) -> None:
        """Forget the memories of this layout's parameters kept under keys it does not hold:
        the second memory's pieces owned elsewhere now, and a two-hop share's parts of
        parameters cut otherwise (DDP's buckets rebuilt after the first step, or a restart)."""
        numbers = set(layout.numbers)
        for memory, held in ((self.error, layout.keys), (self.owner_error, layout.piece_keys)):
            for key in set(memory) - set(held):
                if key_number(key) in numbers:
                    memory.discard(key)

    def _forget_if_moved(self, here: dict[str, Any]) -> None:
        """Reset the memories if they were saved at another place than ``here`` (another
        rank or world size, or under FSDP2 another shard of the same replicate rank)."""
        saved, self._saved_place = self._saved_place, None
        if saved is None or not place.differs(saved, here) or not (self.error or self.owner_error):
            return
        count = len(self.error) + len(self.owner_error)
        self.error.clear()
        self.owner_error.clear()
        plain = ("world_size", "rank", "topology")
        mesh = {k: v for k, v in saved.items() if k not in plain}
        mesh_here = {k: v for k, v in here.items() if k not in plain}
        where = f"rank {saved['rank']} of {saved['world_size']}"
        where_here = f"rank {here['rank']} of {here['world_size']}"
        if saved["topology"] != here["topology"]:
            where += f" on the path {saved['topology']!r}"
            where_here += f" on the path {here['topology']!r}"
        if mesh != mesh_here:
            where += f", {place.describe(mesh)}"
            where_here += f", {place.describe(mesh_here)}"
        warn_once(
            f"quantization-moved-{sorted(saved.items())}-{sorted(here.items())}",
            f"{OWNER}: the error memories ({count} tensors) were saved by {where} and are used "
            f"by {where_here}: each rank's memory describes its own elements, so they were "
            "reset. Save every rank's state (commhooks.integrations.checkpoint.PerRankState) "
            "and load each rank's own file, with the same world size, mesh and machines, to "
            "keep them.",
        )

    # -- checkpointing --------------------------------------------------------------------------
    def _save(self) -> dict[str, Any]:
        world, rank = _place(self.process_group)
        generators = self._generator_states
        if self._generators:
            generators = torch.stack([g.get_state() for g in self._generators])
        return {
            "iter": self.iter,
            "world_size": world,
            "rank": rank,
            "place": {**self.mesh_place, "topology": self._shape},
            "error": self.error.state_dict(),
            "owner_error": self.owner_error.state_dict(),
            "generators": torch.empty(0, dtype=torch.uint8) if generators is None else generators,
        }

    def _load(self, state_dict: Mapping[str, Any]) -> None:
        where = f"{OWNER}.load_state_dict"
        for key in ("iter", "world_size", "rank", "place", "error", "owner_error", "generators"):
            if key not in state_dict:
                raise StateDictError(
                    f"{where}: missing entry {key!r}. Pass the unchanged output of state_dict()."
                )
        step = check_count(f"{where} 'iter'", state_dict["iter"])
        world = check_count(f"{where} 'world_size'", state_dict["world_size"], minimum=-1)
        rank = check_count(f"{where} 'rank'", state_dict["rank"], minimum=-1)
        error, owner_error = self._memory(), self._memory()
        error.load_state_dict(state_dict["error"], _checked_key, f"{OWNER} 'error'")
        where_owner = f"{OWNER} 'owner_error'"
        owner_error.load_state_dict(state_dict["owner_error"], _checked_piece, where_owner)
        generators = _checked_generators(f"{OWNER} 'generators'", state_dict["generators"])
        saved_mesh = place.checked(f"{OWNER} 'place'", state_dict["place"])
        agreed = self.handshake_fields()
        self.iter, self.error, self.owner_error = step, error, owner_error
        self._generator_states, self._generators = generators, []
        saved = {"world_size": world, "rank": rank, "topology": FLAT, **saved_mesh}
        self._saved_place = saved if world > 0 and rank >= 0 else None
        self._layouts.clear()  # pieces of the loaded second memory are sorted out anew
        if self.handshake_fields() != agreed:
            # Another step count: the ranks must agree on it again (a reload of the same step
            # keeps the check, so that one rank may reload alone).
            if self._checked is not None:
                self._reloaded = f"from step {agreed['iter']} to step {step}"
            self._checked = None


def _checked_key(name: str) -> Key:
    """A first memory's key: a parameter's number, or a part's ``"number:first-stop"``."""
    return int(name) if name.strip().isdigit() else _checked_piece(name)


def _keys(numbers: tuple[int, ...], bucket: "GradBucket | Any") -> tuple[Key, ...]:
    """The first memory's keys of a bucket's gradients: each parameter's number, or where the
    bucket holds parts of parameters (``bucket.parts()``, a two-hop share) the part's."""
    held = getattr(bucket, "parts", None)
    parts = held() if callable(held) else None
    if parts is None:
        return numbers
    return tuple(n if p is None else piece_key(n, *p) for n, p in zip(numbers, parts))


def _checked_piece(name: str) -> str:
    _parse_piece_key(name)
    return name


_CUDA_GENERATOR_BYTES = 16


def _checked_generators(where: str, value: Any) -> torch.Tensor | None:
    states = check_tensor(where, value, dtype=torch.uint8)
    if states.numel() == 0:
        return None
    if states.dim() != 2 or states.shape[0] != len(_PHASES):
        raise StateDictError(
            f"{where} must hold {len(_PHASES)} generator states, one a row; got shape "
            f"{tuple(states.shape)}."
        )
    for row in states:
        try:
            torch.Generator().set_state(row.clone())
        except RuntimeError as exc:
            # A CUDA generator's state is its seed and offset, 16 bytes; it is checked when set.
            if row.numel() != _CUDA_GENERATOR_BYTES:
                raise StateDictError(f"{where} is not a generator state ({exc}).") from exc
            if not torch.cuda.is_available():
                raise StateDictError(
                    f"{where} holds a CUDA generator's state ({row.numel()} bytes), and this "
                    "process has no CUDA device: stochastic rounding on CPU needs a CPU "
                    "generator's state. Load a checkpoint saved by a CPU run, or drop the entry's "
                    "contents (generators=torch.empty(0, dtype=torch.uint8)) to reseed."
                ) from exc
    return states.clone()


def _place(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(world size, rank)`` in ``group``, or ``(-1, -1)`` without torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return comm.world_size(group), comm.group_rank(group)
    return -1, -1


# Pickles and reprs name the public module, whichever module defines the class.
QuantizationState.__module__ = "commhooks.hooks.quantized"
QuantizationOptions.__module__ = "commhooks.hooks.quantized"


def _gather(found: list[torch.Tensor | None], places: tuple[torch.Tensor, ...]) -> None:
    """Put each remembered error in its place (zeros where there is none), unless it is
    there already, as the last step's errors are: batched, one launch each on a GPU."""
    zeros = [spot for residual, spot in zip(found, places) if residual is None]
    moved = [(spot, r) for r, spot in zip(found, places) if r is not None and r is not spot]
    for spot in zeros:  # the first step, or the first after a load
        spot.zero_()
    if moved:
        torch._foreach_copy_([spot for spot, _ in moved], [r for _, r in moved])


def _scatter(
    buffer: torch.Tensor,
    layout: BucketLayout,
    places: tuple[torch.Tensor, ...],
    found: list[torch.Tensor | None] | None,
) -> None:
    """Put each parameter's gradient (plus its remembered error, if any) in its place in the
    rows: for a bucket whose order is not the layout's."""
    for i, (source, size, spot) in enumerate(zip(layout.sources, layout.sizes, places)):
        gradient = buffer[source : source + size]
        residual = None if found is None else found[i]
        if residual is None:
            spot.copy_(gradient)
        else:
            torch.add(gradient, residual, out=spot)


def _piece_sizes(gradients: list[torch.Tensor], buffer: torch.Tensor) -> tuple[int, ...]:
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
