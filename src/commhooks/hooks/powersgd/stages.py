"""One bucket's PowerSGD step: its matrices, their batches, and the stages both pipelines share.

A hook turns a bucket into a :class:`BucketStep` (which gradients are matrices to compress,
which are sent as they are) and hands it to a pipeline, :mod:`.two_rounds` or
:mod:`.one_round`, which reads as the algorithm and calls the stages here. The stages use the
state's parts through their public methods: ``state.memory`` (error feedback),
``state.factors`` (warm start), ``state.rng`` (PyTorch's seeds); the arithmetic is
:mod:`commhooks.compress.lowrank`'s. The pipelines issue the collectives, through :mod:`commhooks.comm`;
here only :func:`fall_back` does, and :meth:`BucketStep.follow_up` hands a pipeline's next
round to the state's issuer.

Factors of all matrices live in flat buffers, one factor after another, so that one collective
carries them all; a batch's factor is a ``(batch, rows, rank)`` view into such a buffer.
"""

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from commhooks import _reads, comm, finiteness
from commhooks.compress import lowrank
from commhooks.compress.error_feedback import Absorbed, Key
from commhooks.compress.factors import P_STEP, Q_STEP

from .state import PowerSGDState

__all__ = [
    "Batch",
    "BucketStep",
    "Matrix",
    "Run",
    "approximate",
    "compensate",
    "factor_view",
    "fall_back",
    "finish_single",
    "first_factors",
    "form_batches",
    "kinds",
    "known_shape",
    "lay_out",
    "project",
    "take_vectors",
    "sends_q",
    "sent_shape",
    "starts_from_q",
]

Shape = tuple[int, int, int]
T = TypeVar("T")


@dataclass
class Matrix:
    """A gradient of the bucket compressed as a matrix ``M`` (n x m)."""

    key: Key
    view: torch.Tensor  # (n, m): where M is built and the approximation is written
    rank: int
    step: str  # factors.BOTH, or the one factor a single-round step refines
    compensated: bool = False  # the remembered error was added to ``view``
    absorbed: Absorbed | None = None  # single round, alone: the gradient added into the memory


@dataclass
class Batch:
    """Matrices of one shape, rank and step, compressed with batched products (or one alone).

    A step makes one for each matrix alone, so what only some steps use is made when first
    asked for: a view costs the host about a microsecond, a bucket of a hundred matrices a
    tenth of a millisecond for each view that nobody reads."""

    matrices: list[Matrix]
    copy: torch.Tensor | None  # several matrices: their (B, n, m) copy, filled once M is formed
    # The factors the step starts from and sends, (B, ., r): views that Run.give_views sets.
    known: torch.Tensor = field(init=False)
    sent: torch.Tensor = field(init=False)

    @property
    def stacked(self) -> bool:
        return len(self.matrices) > 1

    @functools.cached_property
    def stack(self) -> torch.Tensor:
        """(B, n, m): the stacked copy, or a view of the single matrix."""
        return self.copy if self.copy is not None else self.matrices[0].view.unsqueeze(0)

    @property
    def refines_q(self) -> bool:
        """A single-round step that computes ``Q = Mᵀ P`` from the last ``P``."""
        return self.matrices[0].step == Q_STEP

    def dims(self) -> tuple[int, int, int, int]:
        """``(matrices, rows, cols, rank)``."""
        n, m = self.matrices[0].view.shape
        return len(self.matrices), n, m, self.matrices[0].rank


@dataclass
class Run:
    """Consecutive batches of one shape, rank and step: their factors are one stack in each
    flat buffer, so that the work on all of them is one batched call."""

    batches: list[Batch]
    known: torch.Tensor = field(init=False)  # every batch's ``known``, in order, (count, ., r)
    sent: torch.Tensor = field(init=False)  # every batch's ``sent``, in order
    count: int = 0  # matrices in all its batches
    # Matrices alone, laid out at a regular stride in one buffer (a bucket's layers of one
    # width usually are): a (count, n, m) view of them all, for batched products; else None.
    stack: torch.Tensor | None = None
    viewed: bool = False  # its batches have their views of known and sent (give_views)

    @property
    def refines_q(self) -> bool:
        return self.batches[0].refines_q

    def matrices(self) -> list[Matrix]:
        return [m for b in self.batches for m in b.matrices]

    def dims(self) -> tuple[int, int, int, int]:
        """``(matrices, rows, cols, rank)``."""
        _, n, m, rank = self.batches[0].dims()
        return self.count, n, m, rank

    def give_views(self) -> None:
        """Give each batch its views of the run's ``known`` and ``sent`` (once a step, and
        only where a batch's own factors are used: its own products, or a random start)."""
        if self.viewed:
            return
        self.viewed = True
        if len(self.batches) == 1:
            self.batches[0].known, self.batches[0].sent = self.known, self.sent
            return
        counts = [len(b.matrices) for b in self.batches]
        known, sent = self.known.split_with_sizes(counts), self.sent.split_with_sizes(counts)
        for b, kv, sv in zip(self.batches, known, sent):
            b.known, b.sent = kv, sv

    def products(self, right: bool) -> list[lowrank.Product]:
        """The products of this run's factors: ``M known -> sent`` (``Mᵀ`` where the run
        refines ``Q``), or with ``right`` ``Mᵀ sent -> known``. ``Mᵀ P`` is one batched product
        over a strided stack (its kernel computes each matrix's product as one product per
        matrix does); ``M Q`` is one product per batch, whose bits a batched kernel does not
        keep for thin factors."""
        if right and self.stack is not None:
            return [(self.stack, self.sent, self.known, True)]
        if self.refines_q and self.stack is not None:
            return [(self.stack, self.known, self.sent, True)]
        self.give_views()
        if right:
            return [(b.stack, b.sent, b.known, True) for b in self.batches]
        return [(b.stack, b.known, b.sent, b.refines_q) for b in self.batches]


@dataclass
class BucketStep:
    """Everything one hook call needs, from its first collective to its result."""

    state: PowerSGDState
    bucket: dist.GradBucket
    buffer: torch.Tensor  # what the hook's future resolves to
    group: dist.ProcessGroup
    matrices: list[Matrix]
    vectors: list[torch.Tensor]  # sent as they are (vectors, small matrices)
    vector_keys: list[Key]
    writeback: Callable[[], object] | None = None  # copies the matrices' results into ``buffer``
    batches: list[Batch] = field(default_factory=list)
    runs: list[Run] = field(default_factory=list)
    _scratch: torch.Tensor | None = None
    _made: list[torch.Tensor] = field(default_factory=list)
    starts: torch.Tensor | None = None  # the starting Q, with warm start (see project)
    _finite: finiteness.QueuedFiniteness | None = None
    _held: bool = False  # its check is held with the step's others (see queue_check)

    def scratch(self) -> torch.Tensor:
        """One block's worth of working memory for the blocked products, made once per call."""
        if self._scratch is None:
            sizes = (
                lowrank.scratch_elements(r.batches[0].matrices[0].view, r.dims()[3])
                for r in self.runs
            )
            self._scratch = self.made(self.buffer.new_empty(max(sizes, default=0)))
        return self._scratch

    def new_flat(self, numel: int) -> torch.Tensor:
        """An uninitialised flat buffer like the bucket's."""
        return self.made(self.buffer.new_empty(numel))

    def made(self, tensor: torch.Tensor) -> torch.Tensor:
        """Register a tensor made for this step (see :meth:`write_back`); returns it."""
        self._made.append(tensor)
        return tensor

    def vector_numel(self) -> int:
        return sum(t.numel() for t in self.vectors)

    def follow_up(
        self,
        after: "torch.futures.Future[Any]",
        then: "Callable[[Any], torch.futures.Future[T]]",
    ) -> "torch.futures.Future[T]":
        """Run ``then(after's value)`` in the state's issuer, in a slot reserved now (see
        :meth:`commhooks.comm.OrderedIssuer.then`); it may issue one collective, on the
        issuer's group. Call on DDP's thread. On a GPU the follow-up is held until the step's
        last bucket; a check it reads (:meth:`finite`) is best queued before
        (:meth:`queue_check`).
        """
        options = comm.follow_up_options(self.buffer, self.bucket.is_last())
        return self.state.issuer.then(after, then, *options)

    def queue_check(self, *tensors: torch.Tensor) -> None:
        """The check :meth:`finite` answers next, started now: on a GPU held with the step's
        other buckets' and answered with them in one read (:class:`finiteness.HeldChecks`);
        on a CPU their total, formed now (:class:`finiteness.QueuedFiniteness`)."""
        if tensors and finiteness.queues(tensors[0]):
            self._held = True
            _held_checks(self.state.issuer).hold(self, *tensors)
        else:
            self._finite = finiteness.QueuedFiniteness(*tensors)

    def finite(self, *tensors: torch.Tensor) -> bool:
        """Whether ``tensors`` (reduced: the same on every rank) are all finite: from the check
        :meth:`queue_check` started, if it did, else read now (on a CPU, where that is free)."""
        if self._held:
            self._held = False
            return _held_checks(self.state.issuer).finite(self)
        queued, self._finite = self._finite, None
        return (queued or finiteness.QueuedFiniteness(*tensors)).all_finite()

    def write_back(self) -> torch.Tensor:
        """Finish the step: the bucket holds the result; return it.

        On a GPU the step's tensors were made on DDP's stream and are last used here, on a
        callback's stream, whose kernels may still be queued when the tensors are dropped.
        The allocator is told so; otherwise it would hand their memory to the next tensor made
        on DDP's stream while those kernels still read it.
        """
        if self.writeback is not None:
            self.writeback()
        comm.used_on_current_stream(self._made)
        return self.buffer


def _held_checks(issuer: comm.OrderedIssuer | None) -> finiteness.HeldChecks:
    """The held checks of the buckets whose decisions ``issuer`` runs."""
    if issuer is None:
        raise RuntimeError("PowerSGD's finiteness check needs the state's issuer; none was made.")
    return finiteness.held_for(issuer)


# -- error feedback ------------------------------------------------------------------------------
def compensate(
    step: BucketStep, stacked_only: bool = False, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Add the remembered error to each tensor sent as it is and to each matrix, in place
    (M = gradient + previous error), in one call to the memory; return the tensors sent as
    they are, packed into ``out`` (by default a new flat buffer).

    With ``stacked_only`` (single round) only matrices compressed with others are compensated:
    one alone has its gradient absorbed into the memory instead (see
    :meth:`LazyErrorFeedback.absorb_`). Stacked copies are filled after this (see
    :func:`first_factors`), from M.
    """
    packed = step.new_flat(step.vector_numel()) if out is None else out
    matrices = step.matrices
    if stacked_only:
        matrices = [m for b in step.batches if b.stacked for m in b.matrices]
    if step.state.settings.use_error_feedback:
        keys = [*step.vector_keys, *(m.key for m in matrices)]
        tensors = [*step.vectors, *(m.view for m in matrices)]
        added = step.state.memory.compensate_all_(keys, tensors)
        for m, was in zip(matrices, added[len(step.vectors) :]):
            m.compensated = was
    return lowrank.pack_into(step.vectors, packed)


def fall_back(step: BucketStep) -> "torch.futures.Future[torch.Tensor]":
    """Send the bucket as plain allreduce would, with the memory as it was before the step.

    For a result that is not finite: some rank's gradient or memory held inf or NaN. The
    result, reduced, is the same on every rank, so every rank comes here, and a loss scaler
    sees inf/NaN exactly where plain allreduce puts them. A follow-up collective: call it in
    the issuer's slot. A memory that was not finite is reset, with a warning.
    """
    withdrawn = list(zip(step.vector_keys, step.vectors))
    withdrawn += [(m.key, m.view) for m in step.matrices if m.compensated]
    absorbed = [m.absorbed for m in step.matrices if m.absorbed is not None]
    step.state.memory.abandon_(withdrawn, absorbed)
    return comm.average(step.buffer, step.state.issuer.group)


# -- batches and the layout of their factors ---------------------------------------------------
def kinds(step: BucketStep) -> list[list[Matrix]]:
    """Matrices compressed together: of one shape, rank and step if batching, else alone."""
    together = step.state.settings.batch_tensors_with_same_shape
    by_kind: dict[tuple[object, ...], list[Matrix]] = {}
    for m in step.matrices:
        kind = (tuple(m.view.shape), m.rank, m.step) if together else (id(m),)
        by_kind.setdefault(kind, []).append(m)
    return list(by_kind.values())


def form_batches(step: BucketStep, kinds: list[list[Matrix]]) -> None:
    """One :class:`Batch` per kind, and the runs of consecutive batches of one shape."""
    for matrices in kinds:
        copy = None
        if len(matrices) > 1:  # a copy, filled once M is formed (see first_factors)
            first = matrices[0].view
            copy = step.made(first.new_empty((len(matrices), *first.shape)))
        step.batches.append(Batch(matrices, copy))
    for b in step.batches:
        last = step.runs[-1] if step.runs else None
        if last is not None and _same_kind(last.batches[-1], b):
            last.batches.append(b)
        else:
            step.runs.append(Run([b]))
    for run in step.runs:
        run.count = sum(len(b.matrices) for b in run.batches)
        if len(run.batches) > 1 and run.count == len(run.batches):
            run.stack = _strided([b.matrices[0].view for b in run.batches])


def _strided(views: list[torch.Tensor]) -> torch.Tensor | None:
    """One ``(len(views), n, m)`` view of same-shaped contiguous ``views``, if they lie at one
    stride from each other in one storage; else ``None``."""
    first = views[0]
    offsets = [v.storage_offset() for v in views]
    delta = offsets[1] - offsets[0]
    storage = first.untyped_storage().data_ptr()
    if delta < first.numel() or any(b - a != delta for a, b in zip(offsets, offsets[1:])):
        return None
    if not all(v.is_contiguous() and v.untyped_storage().data_ptr() == storage for v in views):
        return None
    return first.as_strided((len(views), *first.shape), (delta, *first.stride()), offsets[0])


def _same_kind(a: Batch, b: Batch) -> bool:
    first, other = a.matrices[0], b.matrices[0]
    return (first.view.shape, first.rank, first.step) == (other.view.shape, other.rank, other.step)


def known_shape(b: Batch | Run) -> Shape:
    """The factor a step starts from: ``P`` (B, n, r) for a Q step, else ``Q`` (B, m, r)."""
    count, n, m, rank = b.dims()
    return (count, n, rank) if b.refines_q else (count, m, rank)


def sent_shape(b: Batch | Run) -> Shape:
    """The factor a step computes and sends first: ``Q`` for a Q step, else ``P``."""
    count, n, m, rank = b.dims()
    return (count, m, rank) if b.refines_q else (count, n, rank)


def lay_out(step: BucketStep, leading: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat buffers for the factors each batch starts from and sends, and their views.

    Returns ``(known, send)``; ``send`` begins with ``leading`` elements for the caller (the
    tensors sent as they are), then every batch's sent factor. A run's factors are one stack
    in each buffer; its batches' factors are views of that stack, made where they are used
    (:meth:`Run.give_views`).
    """
    known = step.new_flat(sum(math.prod(known_shape(r)) for r in step.runs))
    send = step.new_flat(leading + sum(math.prod(sent_shape(r)) for r in step.runs))
    k, s = 0, leading
    for run in step.runs:
        shape, shape_sent = known_shape(run), sent_shape(run)
        run.known = factor_view(known[k : k + math.prod(shape)], shape, starts_from_q(run))
        run.sent = factor_view(send[s : s + math.prod(shape_sent)], shape_sent, sends_q(run))
        k, s = k + math.prod(shape), s + math.prod(shape_sent)
    return known, send


def factor_view(flat: torch.Tensor, shape: Shape, is_q: bool) -> torch.Tensor:
    """A ``(batch, rows, rank)`` factor; ``Q`` factors are stored as ``Qᵀ`` (rank x rows).

    With ``Qᵀ`` contiguous, ``M Q``, ``Mᵀ P`` (computed as ``(Pᵀ M)ᵀ``) and ``P Qᵀ`` all read ``M``
    row by row; CPU BLAS is several times slower on an n x 2 right-hand side stored row-major.
    """
    if not is_q:
        return flat.view(shape)
    batch, rows, rank = shape
    return flat.view(batch, rank, rows).transpose(1, 2)


def starts_from_q(b: Batch | Run) -> bool:
    """Whether the factor a batch starts from is a ``Q``: it is, except on a Q step."""
    return not b.refines_q


def sends_q(b: Batch | Run) -> bool:
    """Whether the factor a batch sends first is a ``Q``: only on a Q step."""
    return b.refines_q


def _merged(runs: list[Run], known: bool) -> list[torch.Tensor]:
    """The runs' known (or sent) factors, consecutive stacks of one shape and layout joined.

    A bucket's layers mostly share a few widths: each joined stack is orthogonalised with
    one batched call, which saves many small operations on the critical path.
    """
    stacks: list[torch.Tensor] = []
    for run in runs:
        stack = run.known if known else run.sent
        last = stacks[-1] if stacks else None
        if (
            last is not None
            and last.shape[1:] == stack.shape[1:]
            and last.stride() == stack.stride()
            and last.data_ptr() + last.numel() * last.element_size() == stack.data_ptr()
        ):
            stacks[-1] = last.as_strided(
                (last.shape[0] + stack.shape[0], *stack.shape[1:]),
                stack.stride(),
                last.storage_offset(),
            )
        else:
            stacks.append(stack)
    return stacks


# -- the factors -------------------------------------------------------------------------------
def first_factors(step: BucketStep, single: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch the matrices, fill each batch's starting factor (stored or random, orthogonalised)
    and form from it the factor it sends: ``P = M Q``, or ``Q = Mᵀ P`` on a Q step.

    Returns the flat buffers ``(known, send)``. For the ``single`` round, ``send`` begins with
    the tensors sent as they are, compensated here (:func:`compensate`), and with error
    feedback a matrix alone has its factor formed by the memory as it adds the gradient in
    (:meth:`LazyErrorFeedback.absorb_`). For two rounds, call :func:`compensate` first.
    """
    form_batches(step, kinds(step))
    known, send = lay_out(step, step.vector_numel() if single else 0)
    _fill_starts(step, known)
    settings = step.state.settings
    alone = single and settings.use_error_feedback
    products = [
        product
        for run in step.runs
        if run.batches[0].stacked or not alone
        for product in run.products(right=False)
    ]
    singles = [b for b in step.batches if alone and not b.stacked]
    steps = [  # the singles' in order: a run holds either batches alone or one stacked batch
        (m.key, m.view, known, sent)
        for run in step.runs
        if alone and not run.batches[0].stacked
        for m, known, sent in zip(run.matrices(), run.known.unbind(0), run.sent.unbind(0))
    ]
    # The singles' gradients a run at a time where they lie at one stride: on a CPU checked
    # first with one sum (the memory would read one back a gradient), on a GPU's branch
    # zeroed where not finite and checked with one launch a run, not one a matrix.
    gradients = _alone_stacks(step) if singles else []
    method = "qr" if settings.single_round else "auto"  # its own numerics: the faster QR
    starts = _merged(step.runs, known=True)
    scratch = step.scratch()
    eps = settings.orthogonalization_epsilon
    unc = step.vector_numel()
    if single:
        compensate(step, stacked_only=True, out=send[:unc])
    for b in step.batches:
        if b.stacked:  # a copy of M, now formed
            torch.stack([m.view for m in b.matrices], out=b.stack)
    checks = bool(singles) and _reads.are_free(gradients[0])  # a read a block: CPU only
    finite = checks and lowrank.is_finite(*gradients)
    lowrank.project_(starts, products, eps, method, exact=not settings.single_round)
    if singles:
        refines = [b.refines_q for b in singles]
        stacks = None if checks else gradients
        absorbed = step.state.memory.absorb_all_(steps, refines, scratch, finite, send, stacks)
        for b, each in zip(singles, absorbed):
            b.matrices[0].absorbed = each
    return known, send


def _alone_stacks(step: BucketStep) -> list[torch.Tensor]:
    """The gradients of the matrices compressed alone, in the order of their runs, as stacks:
    a run's strided view of them all where they lie at one stride, else each on its own."""
    stacks: list[torch.Tensor] = []
    for run in step.runs:
        if not run.batches[0].stacked:
            stacks += [run.stack] if run.stack is not None else [b.stack for b in run.batches]
    return stacks


def _fill_starts(step: BucketStep, known: torch.Tensor) -> None:
    """Fill each batch's starting factor: the stored one (warm start) or a random projection.

    A bucket call that needs any random projection draws one seed from the state's numpy
    generator and samples, in batch order, on a private CPU generator: the same values on
    every rank, PyTorch's sequence, and the global RNG untouched. A call draws its seed
    wherever PyTorch's hook does (every step without warm start, and on the first step that
    compresses), even with nothing to sample, so that every later bucket draws the seed it
    would draw there: a bucket of vectors only still takes its turn. A run whose factors are
    all stored is copied with one batched operation.
    """
    state, settings = step.state, step.state.settings
    warm = settings.warm_start or settings.single_round
    first = state.iter == settings.start_powerSGD_iter
    gen = _seeded(state) if not warm or first else None
    for run in step.runs:
        shape = known_shape(run)
        which = P_STEP if run.refines_q else Q_STEP
        stored = [
            state.factors.start(which, m.key, shape[1:], known) if warm else None
            for m in run.matrices()
        ]
        if all(t is not None for t in stored):
            # ``start`` returns only factors of this shape: one stacking copy fills the run.
            torch.stack([t for t in stored if t is not None], out=run.known)
            continue
        gen = _random_starts(state, run, stored, gen)


def _random_starts(
    state: PowerSGDState,
    run: Run,
    stored: list[torch.Tensor | None],
    gen: torch.Generator | None,
) -> torch.Generator:
    """Fill a run's starting factors batch by batch, drawing where none is stored."""
    if gen is None:
        gen = _seeded(state)
    run.give_views()
    at = 0
    for b in run.batches:
        mine, at = stored[at : at + len(b.matrices)], at + len(b.matrices)
        shape = known_shape(b)
        if all(t is None for t in mine):
            b.known.copy_(torch.randn(shape, generator=gen, dtype=b.known.dtype))
            continue
        for i, t in enumerate(mine):
            if t is None:
                t = torch.randn((1, *shape[1:]), generator=gen, dtype=b.known.dtype)
            b.known[i].copy_(t.reshape(shape[1:]))
    return gen


def _seeded(state: PowerSGDState) -> torch.Generator:
    return torch.Generator().manual_seed(int(state.rng.randint(1_000_000_000)))


def take_vectors(step: BucketStep, packed: torch.Tensor) -> None:
    """The tensors sent as they are take their average, ``packed``; their error is remembered."""
    errors = None
    if step.state.settings.use_error_feedback:
        errors = step.state.memory.slots(step.vector_keys, step.vectors)
    lowrank.unpack_remembering_(packed, step.vectors, errors)


def project(step: BucketStep, q: torch.Tensor) -> None:
    """Each summed ``P`` orthogonalised and ``Q = Mᵀ P`` written over the starting ``Q`` in
    ``q``, the buffer sent next. Touches neither the bucket nor the memory, so a step that
    turns out not finite can still fall back (:func:`fall_back`).

    With warm start, a copy of the starting ``Q`` is kept as ``step.starts``: a direction the
    new ``Q`` loses is taken from it (see :func:`approximate`).
    """
    settings = step.state.settings
    step.starts = step.made(q.clone()) if settings.warm_start else None
    products = [product for run in step.runs for product in run.products(right=True)]
    stacks = _merged(step.runs, known=False)
    eps = settings.orthogonalization_epsilon
    lowrank.project_(stacks, products, eps, "auto")


def approximate(step: BucketStep, q: torch.Tensor) -> None:
    """After the second round: ``P Qᵀ`` into each matrix, ``M - P Qᵀ`` remembered as its error,
    and each averaged ``Q`` (in ``q``) kept for the next step's warm start.

    A zero column of Q (a zero gradient, or one of lower rank) would stay zero at every later
    step: M·0 = 0. Its previous direction, from ``step.starts`` (laid out as ``q``), is kept
    instead.
    Every error slot is taken from the memory at once, then every product written in one call.
    """
    matrices = [m for run in step.runs for m in run.matrices()]
    groups = _reconstructions(step.runs)
    previous, starts = [], step.starts
    if starts is not None:
        at = starts.storage_offset() - q.storage_offset()
        previous = [
            starts.as_strided(r.known.shape, r.known.stride(), r.known.storage_offset() + at)
            for r in step.runs
        ]
    scratch = step.scratch()
    errors: list[torch.Tensor] | None = None
    if step.state.settings.use_error_feedback:
        errors = step.state.memory.slots([m.key for m in matrices], [m.view for m in matrices])
    lowrank.reconstruct_all_(groups, errors, scratch)
    kept = [lowrank.keep_nonzero_columns(r.known, old) for r, old in zip(step.runs, previous)]
    factors = step.state.factors
    for run, new in zip(step.runs, kept):
        for m, factor in zip(run.matrices(), new.unbind(0)):
            factors.keep(m.key, None, factor)


def _reconstructions(runs: list["Run"]) -> list[lowrank.Reconstruction]:
    """Each run's matrices with the stacks of their ``P`` and ``Qᵀ``."""
    groups: list[lowrank.Reconstruction] = []
    for run in runs:
        p, q = (run.known, run.sent) if run.refines_q else (run.sent, run.known)
        # Q factors are stored as Qᵀ, so the transpose of a Q stack is contiguous.
        groups.append(([m.view for m in run.matrices()], p, q.transpose(1, 2)))
    return groups


def finish_single(step: BucketStep, averaged: torch.Tensor) -> None:
    """After the single round: the averages into the tensors sent as they are, ``P Qᵀ`` into
    each matrix, and both factors kept with the step each matrix made.

    A matrix compressed with others remembers ``M - P Qᵀ``; one alone had its gradient
    absorbed into the memory, which takes ``P Qᵀ`` out at once if the matrix fits one block
    (one batched subtraction for the bucket) or else keeps it to subtract later.
    """
    stacked = [run for run in step.runs if run.batches[0].stacked]
    alone = [run for run in step.runs if not run.batches[0].stacked]
    matrices = [m for run in stacked for m in run.matrices()]
    singles = [m for run in alone for m in run.matrices()]
    groups, alone_groups = _reconstructions(stacked), _reconstructions(alone)
    copies = [
        (run.known.clone().unbind(0), run.sent.clone().unbind(0))
        if run.refines_q
        else (run.sent.clone().unbind(0), run.known.clone().unbind(0))
        for run in step.runs
    ]
    scratch = step.scratch()
    errors = None
    absorbed = [i for i, m in enumerate(singles) if m.absorbed is not None]
    small = [lowrank.fits_one_block(singles[i].view) for i in absorbed]  # asked once a matrix
    now = [singles[i] for i, fits in zip(absorbed, small) if fits]
    larger = [i for i, fits in zip(absorbed, small) if not fits]
    later = []
    if larger:  # each matrix's own factors, only where a product is kept to subtract later
        p, qt = _factors_of(alone)
        later = [(singles[i].key, p[i], qt[i]) for i in larger]
    memory = step.state.memory if step.state.settings.use_error_feedback else None
    if memory is not None:
        memory.defer_all_(later)
        keys = [*step.vector_keys, *(m.key for m in matrices)]
        errors = memory.slots(keys, [*step.vectors, *(m.view for m in matrices)])
    lowrank.unpack_remembering_(averaged, step.vectors, errors)
    lowrank.reconstruct_all_(
        groups, None if errors is None else errors[len(step.vectors) :], scratch
    )
    lowrank.products_into(alone_groups)
    if memory is not None:  # the small matrices' products, now in their gradients
        memory.subtract_([(m.key, m.view) for m in now])
    factors = step.state.factors
    for run, (ps, qs) in zip(step.runs, copies):
        for m, pi, qi in zip(run.matrices(), ps, qs):
            factors.keep(m.key, pi, qi, m.step)


def _factors_of(runs: list["Run"]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each matrix's ``P`` (n, r) and ``Qᵀ`` (r, m) in ``runs``, in order."""
    p: list[torch.Tensor] = []
    qt: list[torch.Tensor] = []
    for run in runs:
        pr, qr = (run.known, run.sent) if run.refines_q else (run.sent, run.known)
        p += pr.unbind(0)
        qt += qr.transpose(1, 2).unbind(0)
    return p, qt
