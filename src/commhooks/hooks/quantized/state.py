"""The state of the quantized hook: its options, memories, workspaces and checkpoints.

Public through :mod:`commhooks` and :mod:`commhooks.hooks.quantized`; the hook that uses it is
:mod:`commhooks.hooks.quantized.hook`, its options :mod:`~commhooks.hooks.quantized.options`,
the buckets' rows and buffers :mod:`~commhooks.hooks.quantized.layout`.
"""

import threading
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from commhooks import comm, handshake, place
from commhooks._warnings import CommHooksWarning, warn_once
from commhooks.compress import blocks
from commhooks.compress.error_feedback import ErrorFeedback, Key
from commhooks.hooks._bucket import GradBucket
from commhooks.hooks.buckets import SavedBuckets, parse_buckets
from commhooks.hooks.quantized.layout import (
    BucketLayout,
    Workspace,
    bucket_keys,
    checked_key,
    checked_piece,
    describe_key,
    key_number,
    piece_sizes,
)
from commhooks.hooks.quantized.options import FLAT, OWNER, QuantizationOptions
from commhooks.numbering import ParameterNumbering
from commhooks.state import HookState, StateDictError, check_count, check_tensor

__all__ = ["QuantizationState"]

HOOK = "quantized_hook"  # the name the handshake reports for the hook using this state
_PHASES = (0, 1)  # the two quantizations: a rank's own gradient, the average of its row
_OPTION_NAMES = frozenset(QuantizationOptions.names())  # read-only attributes of the state
_describe = describe_key  # the name the pickled memories of earlier releases hold


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
        self.buckets = SavedBuckets()  # the last step's, which a restart's are cut into
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

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("buckets", SavedBuckets())  # pickled before states kept them
        super().__setstate__(state)

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
        if self._pool is None:  # its own, kept: a load at another step makes no new groups
            self._pool = comm.IssuerPool()
        if topology is not None:  # each hop's group has an issuer of its own
            self.hops, self.hop_issuers = self._pool.two_hops(group, topology)
            self._world, self._rank = self.hops.nnodes, self.hops.machine
            comm.crosses_machines(self.hops.peers)
            comm.crosses_machines(self.hops.peers_follow)
        else:
            self.issuer = self._pool.issuer(group)
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
        """Take the follow-ups' issuers from ``pool`` (``None``: a pool of its own) at the next
        first use or new group: states whose averages one thread starts one after another (an
        averager's fragments) share one follow-up group. Not pickled: shared again after."""
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
        keys = bucket_keys(self._numbering.numbers(params), bucket)
        layout = self._layout(keys, piece_sizes(bucket.gradients(), buffer))
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

    def forget_parts_of(self, numbers: set[int]) -> None:
        """Drop the memories of parameters ``numbers``, of which a two-hop share cut anew holds
        no part (DDP's first step cuts one bucket of them all, its rebuild several): kept, they
        would meet no gradient again, not even after a restart, whose buckets are cut as the
        saved run's last (:class:`~commhooks.hooks.buckets.SavedBuckets`)."""
        if not numbers:
            return
        with self._committing:  # other buckets' commits may add keys meanwhile
            for memory in (self.error, self.owner_error):
                for key in [k for k in memory if key_number(k) in numbers]:
                    memory.discard(key)

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
        return ErrorFeedback(OWNER, describe_key, self.settings.format.plausible_residual)

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
            "buckets": self._buckets_saved(),
        }

    def _buckets_saved(self) -> list[list[int]]:
        """The last step's buckets, where DDP had settled on them (warning where a resumed run's
        next step, compressed, will be cut otherwise)."""
        buckets = self.buckets
        compressing = self.iter >= self.settings.warmup_steps  # the next step
        if not buckets.settled and buckets.last and compressing:
            warnings.warn(
                f"{OWNER}.state_dict: saved after the first step of its DDP model (or the "
                "second, with static_graph=True), before DDP rebuilt its buckets, so a run "
                "resumed from it averages its next step in other buckets: not bit for bit "
                "where the model fills several. Save after a later step for a bitwise resume.",
                CommHooksWarning,
                stacklevel=4,
            )
        return [list(b) for b in buckets.saved()]

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
        error.load_state_dict(state_dict["error"], checked_key, f"{OWNER} 'error'")
        where_owner = f"{OWNER} 'owner_error'"
        owner_error.load_state_dict(state_dict["owner_error"], checked_piece, where_owner)
        generators = _checked_generators(f"{OWNER} 'generators'", state_dict["generators"])
        saved_mesh = place.checked(f"{OWNER} 'place'", state_dict["place"])
        buckets = parse_buckets(where, state_dict.get("buckets", []))  # (absent from older files)
        agreed = self.handshake_fields()
        self.iter, self.error, self.owner_error = step, error, owner_error
        self.buckets = SavedBuckets(buckets)
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
