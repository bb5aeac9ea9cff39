"""Streaming DiLoCo: inner steps alone, then an outer step on the averaged change, by fragment.

:class:`StreamingDiLoCo` (DiLoCo, Douillard et al. 2023; its streaming form, arXiv 2501.18512)
is a model averager attached to the inner optimizer: each fragment's outer gradient is averaged
without waiting and applied ``fragment_sync_delay`` inner steps later, in float32 or by the
quantized hook itself on the fragment (a :class:`~commhooks.hooks.buckets.FlatBucket`), with
its error feedback. :func:`diloco_hook` is a worker's DDP hook. A sync whose average is not
finite is undone on the device, nothing read back; a state dict resumes bit for bit, and
loading refuses by name what does not fit the model
(:data:`commhooks.averaging.outer.PLAUSIBLE_CHANGE`).
"""

import hashlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from commhooks import comm
from commhooks.averaging.averagers import ModelAverager
from commhooks.averaging.options import DiLoCoOptions, Fragments
from commhooks.averaging.outer import (
    Layout,
    check_plausible,
    check_snapshot,
    largest_magnitude,
    layout_of,
    load_outer,
    mismatch,
    move_to,
    parse_snapshot,
    step_where_finite,
    warn_replaced,
)
from commhooks.averaging.parameters import Named, average_parameters, named_in_groups
from commhooks.compress.error_feedback import all_finite
from commhooks.hooks._bucket import GradBucket, gradient_buffer
from commhooks.hooks.buckets import FlatBucket, SavedBuckets, parse_buckets, split
from commhooks.hooks.quantized import QuantizationState, quantized_hook
from commhooks.state import StateDictError, check_count, check_tensor

__all__ = [
    "DiLoCoOptions",
    "cross_worker_group",
    "diloco_hook",
    "DiLoCoSyncError",
    "StreamingDiLoCo",
    "split_by_module",
    "state_from_options",
]

OWNER = "StreamingDiLoCo"
HOOK = "diloco_hook"
_KEEP: Any = object()
_OUTER_BLOCK = 512  # values per scale of packed 4-bit outer gradients (see _quantizer)


class DiLoCoSyncError(RuntimeError):
    """A fragment's average failed (a peer lost or stopped); the parameters are as they were."""


def _sync_error(fragment: int, exc: BaseException) -> "DiLoCoSyncError":
    return DiLoCoSyncError(
        f"{OWNER}: averaging fragment {fragment} failed ({exc}). A peer was lost or stopped, "
        "or ended its run a sync early: a worker whose loss scaler skipped a step counts it "
        "only through diloco.end_step() after scaler.step(); the parameters are as this "
        "rank's inner steps left them. Restart every rank from the last checkpoint."
    )


def split_by_module(named: Named, fragments: Fragments) -> list[list[str]]:
    """The parameter names of each fragment.

    A number cuts the modules (a name without its last part), in order, into that many runs of
    about equal size, never splitting a module; a module of no elements joins the fragment
    before it. Given fragments take each parameter listed by name or by a module containing it.

    Raises:
        ValueError: a parameter in no fragment or two, a fragment of no element, or more
            fragments than modules.
    """
    if not isinstance(fragments, int):
        return _match(named, fragments)
    modules: dict[str, list[tuple[str, int]]] = {}
    for name, p in named:
        modules.setdefault(name.rpartition(".")[0], []).append((name, p.numel()))
    runs = [
        ([n for n, _ in members], sum(size for _, size in members)) for members in modules.values()
    ]
    left = sum(1 for _, size in runs if size)  # the modules holding elements, from here on
    if left < fragments:
        raise ValueError(
            f"{OWNER}: fragments={fragments} but the parameters' elements lie in {left} "
            f"modules (of {len(runs)}); pass fragments <= {max(left, 1)} or list the "
            "fragments by name."
        )
    total = sum(size for _, size in runs)
    out: list[list[str]] = [[] for _ in range(fragments)]
    done, last = 0, -1
    for names, size in runs:
        if not size:
            out[max(last, 0)] += names
            continue
        # The fragment whose share of the elements holds this module's middle, kept in order,
        # without a gap, and early enough that each later fragment still gets a module.
        wanted = int((done + size / 2) * fragments / total)
        index = min(max(wanted, last, fragments - left), last + 1)
        out[index] += names
        done, last, left = done + size, index, left - 1
    return _no_empty(out, {name: p.numel() for name, p in named})


def _match(named: Named, fragments: tuple[tuple[str, ...], ...]) -> list[list[str]]:
    out: list[list[str]] = [[] for _ in fragments]
    for name, _ in named:
        owners = [
            i
            for i, prefixes in enumerate(fragments)
            if any(name == m or name.startswith(m + ".") for m in prefixes)
        ]
        if len(owners) != 1:
            where = "no fragment" if not owners else f"fragments {owners}"
            raise ValueError(
                f"{OWNER}: parameter {name!r} is in {where}; every parameter with a gradient "
                "must be in exactly one fragment (list it, or a module containing it, once)."
            )
        out[owners[0]].append(name)
    return _no_empty(out, {name: p.numel() for name, p in named})


def _no_empty(out: list[list[str]], sizes: Mapping[str, int]) -> list[list[str]]:
    empty = [i for i, names in enumerate(out) if not names]
    if empty:
        raise ValueError(
            f"{OWNER}: fragment(s) {empty} hold no parameter with a gradient; give fewer "
            "fragments or list parameters that train."
        )
    hollow = [i for i, names in enumerate(out) if not any(sizes[n] for n in names)]
    if hollow:
        raise ValueError(
            f"{OWNER}: fragment(s) {hollow} hold only parameters of no elements, so they would "
            "sync nothing; list a parameter that holds elements in each, or give fewer fragments."
        )
    return out


@dataclass
class _InFlight:
    """A fragment whose average was issued and is applied at inner step ``apply_at``."""

    fragment: int
    apply_at: int
    flat: torch.Tensor
    # With keep_inflight_steps and a delay: the fragment's own outer gradient at the issue.
    local: torch.Tensor | None = None
    # A worker of several ranks: the share this rank averages, gathered before the apply.
    share: "_Share | None" = None


@dataclass
class _Share:
    """A worker's rank's share of a fragment: ``whole`` (padded to ``ranks`` equal shares) and
    ``bucket``, this rank's part of it (averaged across workers), with the pieces it holds."""

    whole: torch.Tensor
    bucket: FlatBucket
    ranks: int


def _share_of(fragment: FlatBucket, rank: int, ranks: int) -> _Share:
    """Rank ``rank``'s share of ``fragment`` among a worker's ``ranks``."""
    flat = fragment.buffer()
    size = -(-flat.numel() // ranks)
    whole = flat if size * ranks == flat.numel() else flat.new_zeros(size * ranks)
    if whole is not flat:
        whole[: flat.numel()].copy_(flat)
    start = rank * size
    part = whole[start : start + size]
    held, pieces, offset = [], [], 0
    for p in fragment.parameters():
        low, high = max(offset, start), min(offset + p.numel(), start + size)
        if low < high:
            held.append(p)
            pieces.append(part[low - start : high - start])
        offset += p.numel()
    return _Share(whole, FlatBucket(fragment.index(), part, held, pieces), ranks)


class StreamingDiLoCo(ModelAverager):
    """Streaming DiLoCo as a model averager: attach it to the inner optimizer.

    Fragment ``f`` (of ``n``) is applied after inner steps (counted from the warm-up's end)
    ``(f + 1) * sync_every / n + k * sync_every``, and issued ``fragment_sync_delay`` before:
    its outer gradient (global minus local parameters) is averaged over ``process_group``
    without waiting; at the apply, its outer optimizer steps the global parameters with the
    average, and the local ones become them, blended by ``fragment_update_alpha``.

    The global parameters start as the parameters every rank holds before the first inner step
    (:meth:`attach` before the first step, or the last warm-up step), else as their average at
    the first inner step. After the last step call :meth:`finish` on every rank; with a loss
    scaler, :meth:`end_step` after every ``scaler.step(optimizer)``.

    Args:
        sync_every: inner steps between two syncs of a fragment.
        warmup_steps: steps before the first inner step (with :func:`diloco_hook`, gradients
            are averaged over every worker meanwhile).
        process_group: the ranks averaging a fragment, one per worker (``None``: the default
            group, each rank its own worker).
        worker_group: this rank's worker, when it has several ranks (DDP's group).
        mesh: a 2-D device mesh ``(across workers, within a worker)``, instead of both groups.
        **options: the other options of :class:`DiLoCoOptions`.

    Raises:
        ValueError: an option out of range or options that do not fit together, with the fix.
    """

    kind: ClassVar[str] = "streaming_diloco"
    version: ClassVar[int] = 1
    options_class = DiLoCoOptions
    options: DiLoCoOptions
    _transient: ClassVar[tuple[str, ...]] = (
        "_checked",
        "_attached",
        "_worker_group",
        "_in_flight_future",
        "_last_seen",
        "_issuers",
        "_layout",
        "_fitted",
        "_model_agreed",
    )

    def __init__(
        self,
        sync_every: int,
        warmup_steps: int = 0,
        process_group: dist.ProcessGroup | None = None,
        *,
        worker_group: dist.ProcessGroup | None = None,
        mesh: Any = None,
        **options: Any,
    ) -> None:
        settings = DiLoCoOptions.from_mapping(
            {"sync_every": sync_every, "warmup_steps": warmup_steps, **options}
        )
        if mesh is not None:
            process_group, worker_group = _mesh_groups(mesh, process_group, worker_group)
        self._setup(settings, process_group)
        self.outer_optimizer_factory = settings.factory()
        self.snapshot: dict[str, torch.Tensor] | None = None
        self.plan: list[list[str]] | None = None
        self.outer_optimizers: list[torch.optim.Optimizer] = []
        self.quantizers: list[QuantizationState] = []
        self.warmup_quantizer: QuantizationState | None = None  # made by the hook's first use
        self.in_flight: _InFlight | None = None
        self._restore_transient()
        self._worker_group = worker_group

    def _restore_transient(self) -> None:
        super()._restore_transient()
        self._worker_group = None
        self._in_flight_future: torch.futures.Future[torch.Tensor] | None = None
        self._last_seen: dict[str, torch.Tensor] = {}  # the parameters of the last step
        # One follow-up group for every quantized average (all started on the training thread),
        # shared again by those an unpickled averager holds.
        self._issuers = comm.IssuerPool()
        self._share_issuers()
        # The model's parameters as attach() or the first step met them (to check a loaded
        # state); whether a step's were checked since the last load; whether every rank was
        # found to train the same model.
        self._layout: Layout | None = None
        self._fitted = self._model_agreed = False

    def __getstate__(self) -> dict[str, Any]:
        self._settle()  # a pickle holds the fragment in flight as its average
        return super().__getstate__()

    def __setstate__(self, state: dict[str, Any]) -> None:
        kept = state.pop("warmup_buckets", None)  # pickled when the averager kept them itself
        super().__setstate__(state)
        warmup = self.warmup_quantizer
        if isinstance(kept, SavedBuckets) and warmup is not None and not warmup.buckets.saved():
            warmup.buckets = kept

    def bind(
        self, process_group: dist.ProcessGroup | None, worker_group: Any = _KEEP
    ) -> "StreamingDiLoCo":
        """Average fragments over ``process_group`` as a worker of ``worker_group`` (``None``:
        this rank alone; left out: unchanged) from now on, e.g. after unpickling."""
        if worker_group is _KEEP:
            worker_group = self._worker_group
        if worker_group is not None and not isinstance(worker_group, dist.ProcessGroup):
            raise TypeError(
                f"{OWNER}.bind: worker_group must be a ProcessGroup or None, got "
                f"{type(worker_group).__name__}."
            )
        super().bind(process_group)
        self._worker_group = worker_group
        for state in self.quantizers:
            state.bind(process_group)
        if self.warmup_quantizer is not None:
            self.warmup_quantizer.bind(self.warmup_group)
        self._share_issuers()
        return self

    def _share_issuers(self) -> None:
        """Hand this averager's issuer pool to every quantized state it holds."""
        for state in [*self.quantizers, self.warmup_quantizer]:
            if state is not None:
                state.share_issuers(self._issuers)

    def quantizer_for_warmup(self) -> QuantizationState | None:
        """The quantized average of this warm-up step's gradients (``warmup_bits``), made on
        first use; ``None`` after the warm-up or without ``warmup_bits`` (float32)."""
        bits = self.options.warmup_bits
        if bits is None or self.step >= self.warmup_steps:
            return None
        if self.warmup_quantizer is None:
            self.warmup_quantizer = self._quantizer(self.warmup_group, bits)
        return self.warmup_quantizer

    @property
    def warmup_group(self) -> dist.ProcessGroup | None:
        """The group the warm-up averages gradients over, every worker's ranks: the default
        group (``None``) where workers have several ranks, else :attr:`process_group`."""
        return None if self._worker_group is not None else self.process_group

    @property
    def worker_group(self) -> dist.ProcessGroup | None:
        """This rank's worker (``None``: the rank alone)."""
        return self._worker_group

    # -- attaching and starting -----------------------------------------------------------------
    def attach(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    ) -> RemovableHandle:
        """Run after every ``optimizer.step()`` (:meth:`ModelAverager.attach`); before the first
        step of a run without warm-up, take the parameters as the global ones (:meth:`start`).
        Their names, shapes and dtypes are kept, to check a state dict loaded later.

        Raises:
            StateDictError: a state dict loaded before is not this model's; nothing attached.
        """
        named = None if named_parameters is None else list(named_parameters)
        names = None if named is None else {id(p): n for n, p in named}
        every = named_in_groups(optimizer.param_groups, names, with_grad_only=False)
        layout = layout_of(every)
        if self.snapshot is not None:
            _check_fits(f"{OWNER}.attach: the loaded state's", self.snapshot, layout)
        self._layout = layout
        if self.snapshot is None and self.step == 0 and self.warmup_steps == 0:
            self.start(every)
        return super().attach(optimizer, named)

    def start(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take these parameters as the global ones (no collective): on every rank before the
        first inner step, when every rank holds the same. Those without a gradient at the
        first sync are dropped."""
        self.snapshot = {n: p.detach().clone() for n, p in named}
        self.plan, self.outer_optimizers, self.quantizers = None, [], []
        if self._layout is None:
            self._layout = layout_of(self.snapshot.items())

    def finish(self) -> None:
        """Apply the fragment in flight, if any: on every rank after the last step, so that no
        rank leaves its peers' collective without a partner.

        Raises:
            DiLoCoSyncError: the average failed (a peer was lost).
        """
        if self.in_flight is not None and self._last_seen:
            self._finish(self._last_seen)
        self._settle()  # loaded with a fragment in flight, no step since: nothing to apply to

    # -- the schedule, on every rank at the same steps -------------------------------------------
    def handshake_fields(self) -> dict[str, Any]:
        """The schedule, the outer optimizer, the step and what is started or in flight."""
        flight = self.in_flight
        return {
            **self.options.described(),
            "step": self.step,
            "started": self.snapshot is not None,
            "in_flight": None if flight is None else [flight.fragment, flight.apply_at],
        }

    def _group_due(self) -> dist.ProcessGroup | None:
        if self.step < self.warmup_steps:
            return None
        return comm.resolve_group(self.process_group, owner=OWNER)

    def _between_syncs(self, named: Named) -> None:
        if self.step == self.warmup_steps - 1:  # the warm-up kept every rank's parameters equal
            self.start(named)
            self.warmup_quantizer = None  # what its last average left out is not sent

    def _issue_due(self, inner: int) -> int | None:
        """The fragment to issue after inner step ``inner`` (counted from 1), if any."""
        opts = self.options
        phase = (inner + opts.fragment_sync_delay) % opts.sync_every
        if phase % opts.spacing:
            return None
        return (phase // opts.spacing - 1) % opts.fragment_count

    def _average(self, named: Named, group: dist.ProcessGroup) -> None:
        if not named:
            return
        inner = self.step - self.warmup_steps + 1
        if not self._model_agreed:  # before any collective whose size is the model's
            _agree_on_model(named, group)
            self._model_agreed = True
        if self.snapshot is None:  # neither attached before the first step nor started
            average_parameters([p for _, p in named], group)
            self.start(named)
        lookup = self._last_seen = self._fit(named, group)
        fragment = self._issue_due(inner)
        if fragment is not None:
            self._issue(fragment, lookup, group, inner)
        if self.in_flight is not None and self.in_flight.apply_at == inner:
            self._finish(lookup)

    # -- one fragment: issue, then apply -------------------------------------------------------
    def _issue(
        self, fragment: int, lookup: dict[str, torch.Tensor], group: dist.ProcessGroup, inner: int
    ) -> None:
        """Start averaging the fragment's outer gradient; nothing waits for it here."""
        assert self.plan is not None and self.snapshot is not None
        if self.in_flight is not None:  # never with a valid schedule: finish it first
            self._finish(lookup)
        names = self.plan[fragment]
        params = [lookup[n] for n in names]
        with torch.no_grad():
            flat = torch.cat(
                [(self.snapshot[n] - p.detach()).reshape(-1).float() for n, p in zip(names, params)]
            )
        # The average is taken in place: this rank's own outer gradient is copied first.
        local = flat.clone() if self.options.keeps_inflight_change else None
        bucket, share, worker = FlatBucket(fragment, flat, params), None, self._worker_group
        if worker is not None and comm.world_size(worker) > 1:  # this rank's share crosses
            share = _share_of(bucket, comm.group_rank(worker), comm.world_size(worker))
            bucket = share.bucket
        try:  # a peer already gone can fail the issue itself, not only the wait
            if self.options.bits is None:
                future = comm.average(bucket.buffer(), group)
            else:  # the quantized hook itself, on the fragment as on a bucket
                hook: Callable[[Any, Any], torch.futures.Future[torch.Tensor]] = quantized_hook
                future = hook(self.quantizers[fragment], bucket)
        except RuntimeError as exc:
            raise _sync_error(fragment, exc) from exc
        apply_at = inner + self.options.fragment_sync_delay
        self.in_flight = _InFlight(fragment, apply_at, flat, local, share)
        self._in_flight_future = future

    def _settle(self) -> None:
        """Wait for the fragment in flight; its average is then in ``in_flight.flat``.
        ``DiLoCoSyncError`` if it failed: the fragment is dropped, nothing changed."""
        future, self._in_flight_future = self._in_flight_future, None
        if future is None or self.in_flight is None:
            return
        flight = self.in_flight
        try:
            averaged = future.wait()
            if flight.share is not None:  # each rank's share, gathered within the worker
                averaged = self._gather_share(flight.share, averaged)
        except RuntimeError as exc:
            fragment, self.in_flight = flight.fragment, None
            raise _sync_error(fragment, exc) from exc
        if averaged.data_ptr() != flight.flat.data_ptr():
            flight.flat.copy_(averaged[: flight.flat.numel()])

    def _gather_share(self, share: "_Share", averaged: torch.Tensor) -> torch.Tensor:
        """The whole fragment's average from each rank's share of it, within the worker: on
        the training thread, where DDP issues its own collectives on that group."""
        assert self._worker_group is not None
        mine = averaged.clone()  # the gather's input apart from its output
        whole = share.whole.view(share.ranks, -1)
        return comm.all_gather_into(whole, mine, self._worker_group).wait().view(-1)

    def _finish(self, lookup: dict[str, torch.Tensor]) -> None:
        """The outer step of the fragment in flight, then local = blend of global and local.

        A non-finite average (a worker's NaN, on every rank alike) would carry into every later
        sync: decided on the device, the outer step is undone (:func:`step_where_finite`) and
        every parameter taken back to the global ones (:meth:`_back_to_global`).
        """
        self._settle()
        flight, self.in_flight = self.in_flight, None
        assert flight is not None and self.plan is not None and self.snapshot is not None
        names, alpha = self.plan[flight.fragment], self.options.fragment_update_alpha
        snaps = [self.snapshot[n] for n in names]
        params = [lookup[n] for n in names]
        outer = self.outer_optimizers[flight.fragment]
        finite = all_finite(flight.flat)
        with torch.no_grad():
            kept = _local_change(flight, snaps, params)
            step_where_finite(outer, snaps, split(flight.flat, snaps), finite)
            for i, (p, snap) in enumerate(zip(params, snaps)):
                if kept is None and alpha == 0:  # the global parameters, finite or not
                    p.copy_(snap)
                    continue
                target = snap if kept is None else snap + kept[i].to(snap.dtype)
                blended = target if alpha == 0 else torch.lerp(target, p, alpha)
                torch.where(finite, blended, snap, out=p)  # a NaN local change is dropped
            self._back_to_global(finite, lookup, names)

    def _back_to_global(
        self, finite: torch.Tensor, lookup: Mapping[str, torch.Tensor], done: Sequence[str]
    ) -> None:
        """Where ``finite`` is false, the parameters of every fragment but ``done`` become the
        global ones: a worker's NaN spreads to every fragment in one forward pass, so reset one
        fragment at a time, each would poison the others again before its own sync."""
        assert self.snapshot is not None
        synced = set(done)
        for name, p in lookup.items():
            if name not in synced:
                torch.where(finite, p, self.snapshot[name], out=p)

    # -- the plan: fragments, global parameters, outer optimizers --------------------------------
    def _fit(self, named: Named, group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
        """``{name: parameter}``, after making the fragments and outer optimizers if needed;
        ``ValueError`` if they are not the global parameters' (:func:`check_snapshot`)."""
        assert self.snapshot is not None
        lookup = dict(named)
        if self.plan is None:
            plan = split_by_module(named, self.options.fragments)
            check_snapshot(OWNER, self.snapshot, lookup, exact=False)
            self.snapshot = {n: self.snapshot[n] for n in lookup}
            self.plan = plan
            self.outer_optimizers = [
                self.outer_optimizer_factory([self.snapshot[n] for n in names]) for names in plan
            ]
            self.quantizers = self._new_quantizers(group, len(plan))
        elif not self._fitted or set(lookup) != set(self.snapshot):
            check_snapshot(OWNER, self.snapshot, lookup)  # loaded since the last step, or changed
        move_to(named[0][1].device, self.snapshot, self.outer_optimizers)
        if self._layout is None:
            self._layout = layout_of(named)
        self._fitted = True
        return lookup

    def _new_quantizers(
        self, group: dist.ProcessGroup | None, count: int
    ) -> list[QuantizationState]:
        bits = self.options.bits
        return [] if bits is None else [self._quantizer(group, bits, True) for _ in range(count)]

    def _quantizer(
        self, group: dist.ProcessGroup | None, bits: int, outer: bool = False
    ) -> QuantizationState:
        # Outer gradients in 4 bits travel packed, a scale per 512 values: smoother than one
        # step's gradient, on the bench's task they train as in 256-value blocks (1024: slower).
        packed = outer and bits == 4
        made = QuantizationState(
            group, bits=bits, packed=packed, block_size=_OUTER_BLOCK if packed else 256
        )
        made.share_issuers(self._issuers)
        return made

    # -- checkpoints: parse everything, then apply ----------------------------------------------
    def _schedule(self) -> dict[str, Any]:
        return {n: _fragments_saved(getattr(self.options, n)) for n in _SCHEDULE}

    # Saved between two steps. A fragment in flight is waited for and saved as its average, to
    # be applied at the same inner step after a resume: the collective's result does not
    # depend on when it is read, so the resumed run is the uninterrupted one, bit for bit.
    def _save(self) -> dict[str, Any]:
        self._settle()
        flight = self.in_flight
        return {
            **super()._save(),
            "bits": self.options.bits,
            "started": self.snapshot is not None,
            "snapshot": {n: t.detach().clone() for n, t in (self.snapshot or {}).items()},
            "plan": [list(names) for names in self.plan or []],
            "outer_optimizers": [o.state_dict() for o in self.outer_optimizers],
            "quantizers": [q.state_dict() for q in self.quantizers],
            "warmup_quantizer": None if (q := self.warmup_quantizer) is None else q.state_dict(),
            "warmup_buckets": self._warmup_buckets_saved(),
            "in_flight": {} if flight is None else _flight_saved(flight),
        }

    def _warmup_buckets_saved(self) -> list[list[int]]:
        """The quantized warm-up's last buckets, which a resumed run's first step is cut into
        (:class:`~commhooks.hooks.buckets.SavedBuckets`), where DDP had settled on
        them: its quantizer's state dict holds them too, and this entry is read from older
        files."""
        if self.warmup_quantizer is None:
            return []
        return [list(b) for b in self.warmup_quantizer.buckets.saved()]

    def _parse(self, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        values = super()._parse(state_dict)
        where = f"{OWNER}.load_state_dict:"
        snapshot = parse_snapshot(where, state_dict, "started")
        if snapshot is not None and self._layout is not None:
            _check_fits(where, snapshot, self._layout)  # else checked by attach() or a step
        plan = _parse_plan(where, state_dict.get("plan"), snapshot)
        outer, replaced = self._parse_outer(
            where, state_dict.get("outer_optimizers"), plan, snapshot
        )
        quantizers = self._parse_quantizers(where, state_dict.get("quantizers"), plan)
        warmup = self._parse_warmup_quantizer(where, state_dict.get("warmup_quantizer"), values)
        # Saved since the warm-up's buckets were: an earlier state cuts nothing. The quantizer
        # of a newer file holds them too.
        buckets = parse_buckets(where, state_dict.get("warmup_buckets", []), "warmup_buckets")
        if warmup is not None and buckets and not warmup.buckets.saved():
            warmup.buckets = SavedBuckets(buckets)
        flight = _parse_flight(where, state_dict.get("in_flight"), plan, snapshot)
        if flight is not None and not self.options.keeps_inflight_change:
            flight.local = None  # saved with keep_inflight_steps, loaded without: not kept
        return {
            **values,
            "snapshot": snapshot,
            "plan": plan,
            "outer": outer,
            "replaced": replaced,
            "quantizers": quantizers,
            "warmup_quantizer": warmup,
            "in_flight": flight,
        }

    def _parse_outer(
        self,
        where: str,
        raw: Any,
        plan: list[list[str]] | None,
        snapshot: dict[str, torch.Tensor] | None,
    ) -> tuple[list[torch.optim.Optimizer], list[tuple[str, Any, Any]]]:
        """Each fragment's outer optimizer, and the saved settings that gave way to this
        averager's own (see :func:`commhooks.averaging.outer.load_outer`)."""
        if not isinstance(raw, list) or len(raw) != len(plan or []):
            raise StateDictError(f"{where} 'outer_optimizers' must hold one state per fragment.")
        made, replaced = [], []
        for i, (names, saved) in enumerate(zip(plan or [], raw)):
            assert snapshot is not None
            entry = f"{where} the outer optimizer of fragment {i}"
            tensors = [snapshot[n] for n in names]
            loaded = load_outer(entry, self.outer_optimizer_factory, saved, tensors)
            made.append(loaded.optimizer)
            replaced += [r for r in loaded.replaced if r not in replaced]
        return made, replaced

    def _parse_quantizers(
        self, where: str, raw: Any, plan: list[list[str]] | None
    ) -> list[QuantizationState]:
        want = 0 if self.options.bits is None or plan is None else len(plan)
        if not isinstance(raw, list) or len(raw) != want:
            raise StateDictError(
                f"{where} 'quantizers' must hold one quantized average's state per fragment "
                f"({want} with bits={self.options.bits}), got "
                f"{len(raw) if isinstance(raw, list) else type(raw).__name__}."
            )
        made = self._new_quantizers(self.process_group, want)
        for state, saved in zip(made, raw):
            state.load_state_dict(saved)
        return made

    def _parse_warmup_quantizer(
        self, where: str, raw: Any, values: Mapping[str, Any]
    ) -> QuantizationState | None:
        """The warm-up's error memories, kept where the resumed step is still in the warm-up
        and ``warmup_bits`` is on (dropped otherwise, as the warm-up's end drops them)."""
        if raw is not None and not isinstance(raw, Mapping):
            raise StateDictError(
                f"{where} 'warmup_quantizer' must be None or a quantized average's state dict, "
                f"got {type(raw).__name__}. Pass the unchanged output of state_dict()."
            )
        bits = self.options.warmup_bits
        if raw is None or bits is None or values["step"] >= values["warmup_steps"]:
            return None
        made = self._quantizer(self.warmup_group, bits)
        try:
            made.load_state_dict(raw)
        except StateDictError as exc:
            raise StateDictError(f"{where} 'warmup_quantizer': {exc}") from exc
        return made

    def _apply(self, values: dict[str, Any]) -> None:
        warn_replaced(OWNER, values["replaced"], self.options.outer_optimizer is None)
        super()._apply(values)
        self._fitted = False  # the next step checks its parameters against the loaded ones
        self.snapshot, self.plan = values["snapshot"], values["plan"]
        self.outer_optimizers, self.quantizers = values["outer"], values["quantizers"]
        self.warmup_quantizer = values["warmup_quantizer"]
        self.in_flight, self._in_flight_future = values["in_flight"], None
        self._last_seen = {}  # finish() with no step since has nothing to apply the loaded to


_SCHEDULE = ("sync_every", "fragments", "fragment_sync_delay")


def _local_change(
    flight: _InFlight, snaps: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
) -> list[torch.Tensor] | None:
    """What the inner steps taken while ``flight`` travelled changed in its parameters (with
    ``keep_inflight_steps``; else ``None``), read before the outer step moves the snapshots:
    the parameters now less those at the issue (the snapshots less the outer gradient then)."""
    if flight.local is None:
        return None
    issued = split(flight.local, snaps)
    return [p.float() - s.float() + g for p, s, g in zip(params, snaps, issued)]


def _agree_on_model(named: Named, group: dist.ProcessGroup) -> None:
    """Raise on every rank of ``group``, naming each rank's parameters, unless all average
    the same: between models of different sizes gloo aborts, and the quantized average pads
    both to whole blocks and averages wrongly without a word."""
    layout = layout_of(named)
    digest = hashlib.sha256(repr(list(layout.items())).encode()).hexdigest()[:12]
    elements = sum(math.prod(shape) for shape, _ in layout.values())
    mine = f"{len(layout)} tensors, {elements} elements, layout {digest}"
    described = comm.all_gather_objects(mine, group)
    if any(other != mine for other in described):
        ranks = "; ".join(f"rank {r}: {d}" for r, d in enumerate(described))
        raise ValueError(
            f"{OWNER}: the workers do not train the same model ({ranks}), so their fragments' "
            "averages would not match. Build the same model on every worker: the same "
            "parameters with gradients, in the same order, shapes and dtypes."
        )


def _check_fits(where: str, snapshot: Mapping[str, torch.Tensor], layout: Layout) -> None:
    """Refuse global parameters that are not the model's (``StateDictError``, by name)."""
    for name, saved in snapshot.items():
        if name not in layout:
            known = ", ".join(repr(n) for n in list(layout)[:4])
            raise StateDictError(
                f"{where} 'snapshot'[{name!r}] is no parameter of the model (which has "
                f"{len(layout)}: {known}...); it was saved for another model. Nothing was "
                "changed; load the checkpoint saved with this model."
            )
        differs = mismatch(saved, layout[name])
        if differs:
            raise StateDictError(
                f"{where} 'snapshot'[{name!r}] {differs}; it was saved for another model. "
                "Nothing was changed; load the checkpoint saved with this model."
            )


def _mesh_groups(
    mesh: Any, process_group: dist.ProcessGroup | None, worker_group: dist.ProcessGroup | None
) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """``(across workers, within a worker)`` from a 2-D device mesh."""
    if process_group is not None or worker_group is not None:
        raise ValueError(f"{OWNER}: pass either mesh or process_group/worker_group, not both.")
    if getattr(mesh, "ndim", None) != 2:
        raise ValueError(
            f"{OWNER}: mesh must be a 2-D DeviceMesh (across workers, within a worker), e.g. "
            "init_device_mesh('cpu', (machines, ranks_per_machine)); got "
            f"{type(mesh).__name__} with ndim={getattr(mesh, 'ndim', None)}."
        )
    return mesh.get_group(0), mesh.get_group(1)


def _flight_saved(flight: _InFlight) -> dict[str, Any]:
    saved = {"fragment": flight.fragment, "apply_at": flight.apply_at, "average": flight.flat}
    return saved if flight.local is None else {**saved, "local": flight.local}


def _fragments_saved(value: Any) -> Any:
    """An option as a state dict holds it: given fragments as lists, the rest as they are."""
    return [list(f) for f in value] if isinstance(value, tuple) else value


def _parse_plan(
    where: str, raw: Any, snapshot: dict[str, torch.Tensor] | None
) -> list[list[str]] | None:
    """The saved fragments, each a list of names of the saved global parameters."""
    if not isinstance(raw, list) or not all(
        isinstance(f, list) and all(isinstance(n, str) for n in f) for f in raw
    ):
        raise StateDictError(f"{where} 'plan' must be a list of fragments, lists of names.")
    if not raw:
        return None
    names = [n for f in raw for n in f]
    if snapshot is None or sorted(names) != sorted(snapshot) or any(not f for f in raw):
        raise StateDictError(
            f"{where} 'plan' must name every global parameter once, in non-empty fragments."
        )
    return [list(f) for f in raw]


def _parse_flight(
    where: str, raw: Any, plan: list[list[str]] | None, snapshot: dict[str, torch.Tensor] | None
) -> _InFlight | None:
    """The saved fragment in flight: its number, the inner step to apply it, its average."""
    if raw == {}:
        return None
    if not isinstance(raw, Mapping) or plan is None or snapshot is None:
        raise StateDictError(f"{where} 'in_flight' is malformed or has no fragments to fit.")
    fragment = check_count(f"{where} 'in_flight' 'fragment'", raw.get("fragment"))
    apply_at = check_count(f"{where} 'in_flight' 'apply_at'", raw.get("apply_at"), minimum=1)
    if fragment >= len(plan):
        raise StateDictError(f"{where} 'in_flight' names fragment {fragment} of {len(plan)}.")
    size = sum(snapshot[n].numel() for n in plan[fragment])
    scale = largest_magnitude(snapshot[n] for n in plan[fragment])
    average = _fragment_tensor(where, raw, "average", size, fragment, scale)
    # Saved only with keep_inflight_steps; without it, the fragment merges as that option's off.
    local = None
    if "local" in raw:
        local = _fragment_tensor(where, raw, "local", size, fragment, scale)
    return _InFlight(fragment, apply_at, average, local)


def _fragment_tensor(
    where: str, raw: Mapping[str, Any], key: str, size: int, fragment: int, scale: float
) -> torch.Tensor:
    """A copy of the saved float32 vector ``raw[key]`` of fragment ``fragment``'s ``size``,
    an outer gradient within the plausible reach of global parameters up to ``scale``."""
    entry = f"{where} 'in_flight' {key!r}"
    flat = check_tensor(entry, raw.get(key), dtype=torch.float32)
    if flat.dim() != 1 or flat.numel() != size:
        raise StateDictError(
            f"{entry} must hold the {size} elements of fragment {fragment}, got shape "
            f"{tuple(flat.shape)}."
        )
    check_plausible(entry, flat, scale)
    return flat.clone()


def diloco_hook(state: StreamingDiLoCo, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP hook of a DiLoCo worker: average gradients within the worker, not across; over
    every worker during the warm-up (in ``warmup_bits`` if given), so that workers start alike.

    Raises:
        ValueError: at the first call, on every rank alike, naming each option that differs
            between the ranks (:meth:`StreamingDiLoCo.agree_with_ranks`).
    """
    if not isinstance(state, StreamingDiLoCo):
        raise TypeError(
            f"{HOOK} needs a commhooks.StreamingDiLoCo as its state, got {type(state).__name__}; "
            f"register it with commhooks.register(ddp_model, 'streaming_diloco', sync_every=...)."
        )
    buffer = gradient_buffer(bucket, HOOK)
    if not state.ranks_agree:  # the options first: they decide what the warm-up sends
        state.agree_with_ranks(comm.resolve_group(state.warmup_group, owner=HOOK))
    worker = state.worker_group
    if state.step < state.warmup_steps:
        quantizer = state.quantizer_for_warmup()
        if quantizer is not None:
            return quantized_hook(quantizer, bucket)
        group = comm.resolve_group(state.warmup_group, owner=HOOK)
    elif worker is None:
        return comm.completed(buffer)
    else:
        group = worker
    return comm.average(buffer, group)


def cross_worker_group(worker_group: dist.ProcessGroup) -> dist.ProcessGroup:
    """The ranks holding this rank's place in every worker: a collective over the default
    group, at the same point on every rank; ``ValueError`` if the workers differ in size or
    overlap."""
    workers: list[list[int]] = []
    for ranks in comm.all_gather_objects(comm.global_ranks(worker_group)):
        if ranks not in workers:
            workers.append(ranks)
    sizes = {len(w) for w in workers}
    flat = [r for w in workers for r in w]
    if len(sizes) != 1 or len(flat) != len(set(flat)):
        raise ValueError(
            f"{OWNER}: the workers' groups must be disjoint and of one size, got {workers}; "
            "give every rank the group of its own machine (e.g. from a 2-D device mesh)."
        )
    places = [[w[i] for w in workers] for i in range(len(workers[0]))]
    return next(g for g in comm.new_groups(places) if g is not None)


def state_from_options(
    group: dist.ProcessGroup | None, options: Mapping[str, Any]
) -> StreamingDiLoCo:
    """The averager :func:`commhooks.register` builds for a DDP model on ``group``: each rank
    its own worker on the default group, else ``group`` the worker (:func:`cross_worker_group`,
    a collective)."""
    if group is None or comm.is_default_group(group):
        return StreamingDiLoCo(process_group=group, **options)
    return StreamingDiLoCo(process_group=cross_worker_group(group), worker_group=group, **options)
