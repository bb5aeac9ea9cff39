"""One bucket's PowerSGD step: its matrices, their batches, and the stages both pipelines share.

A hook turns a bucket into a :class:`BucketStep` (which gradients are matrices to compress,
which are sent as they are) and hands it to a pipeline, :mod:`.two_rounds` or
:mod:`.one_round`, which reads as the algorithm and calls the stages here. The stages use the
state's parts through their public methods: ``state.memory`` (error feedback),
``state.factors`` (warm start), ``state.rng`` (PyTorch's seeds); the arithmetic is
:mod:`commhooks.lowrank`'s. The pipelines issue the collectives, through :mod:`commhooks.comm`;
here only :func:`fall_back` does, and :meth:`BucketStep.follow_up` hands a pipeline's next
round to the state's issuer.

Factors of all matrices live in flat buffers, one factor after another, so that one collective
carries them all; a batch's factor is a ``(batch, rows, rank)`` view into such a buffer.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from commhooks import comm, lowrank
from commhooks.error_feedback import Absorbed, Key
from commhooks.factors import P_STEP, Q_STEP

from .state import PowerSGDState

__all__ = [
    "Batch",
    "BucketStep",
    "Matrix",
    "compensate_matrices",
    "compensate_vectors",
    "decompress",
    "fall_back",
    "form_batches",
    "kinds",
    "known_shape",
    "lay_out_known",
    "lay_out_sent",
    "orthogonalize_all",
    "sends_q",
    "sent_factor",
    "sent_numel",
    "sent_shape",
    "start_factors",
    "starts_from_q",
    "unpack_vectors",
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
    """Matrices of one shape, rank and step, compressed with batched products (or one alone)."""

    matrices: list[Matrix]
    stack: torch.Tensor  # (B, n, m): a view of the single matrix, or a stacked copy
    known: torch.Tensor = field(init=False)  # the factor the step starts from, (B, ., r)
    sent: torch.Tensor = field(init=False)  # the factor the step sends, (B, ., r)

    @property
    def stacked(self) -> bool:
        return len(self.matrices) > 1

    @property
    def refines_q(self) -> bool:
        """A single-round step that computes ``Q = Mᵀ P`` from the last ``P``."""
        return self.matrices[0].step == Q_STEP


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
    _scratch: torch.Tensor | None = None
    _made: list[torch.Tensor] = field(default_factory=list)

    def scratch(self) -> torch.Tensor:
        """One block's worth of working memory for the blocked products, made once per call."""
        if self._scratch is None:
            sizes = (lowrank.scratch_elements(b.stack[0], b.matrices[0].rank) for b in self.batches)
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
        self, after: "torch.futures.Future[Any]", then: "Callable[[Any], torch.futures.Future[T]]"
    ) -> "torch.futures.Future[T]":
        """Run ``then(after's value)`` in the state's issuer, in a slot reserved now (see
        :meth:`commhooks.comm.OrderedIssuer.then`); it may issue one collective, on the
        issuer's group. Call on DDP's thread; it counts the step once the last bucket's
        first round is issued."""
        options = comm.follow_up_options(self.buffer, self.bucket.is_last())
        done = self.state.issuer.then(after, then, *options)
        self.state.maybe_increase_iter(self.bucket)
        return done

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


# -- error feedback ------------------------------------------------------------------------------
def compensate_vectors(step: BucketStep) -> None:
    """Add the remembered error to each tensor sent as it is."""
    if step.state.settings.use_error_feedback:
        for key, t in zip(step.vector_keys, step.vectors):
            step.state.memory.compensate_(key, t)


def compensate_matrices(step: BucketStep, matrices: list[Matrix]) -> None:
    """Add the remembered error to each matrix in place, so M = gradient + previous error."""
    if step.state.settings.use_error_feedback:
        for m in matrices:
            m.compensated = step.state.memory.compensate_(m.key, m.view)


def unpack_vectors(step: BucketStep, averaged: torch.Tensor) -> None:
    """Copy the averages back; remember ``local - mean`` (error feedback, as PyTorch does)."""
    remember, offset = step.state.settings.use_error_feedback, 0
    for key, t in zip(step.vector_keys, step.vectors):
        mean = averaged[offset : offset + t.numel()].view_as(t)
        offset += t.numel()
        if remember:
            torch.sub(t, mean, out=step.state.memory.slot(key, t))
        t.copy_(mean)


def fall_back(step: BucketStep) -> "torch.futures.Future[torch.Tensor]":
    """Send the bucket as plain allreduce would, with the memory as it was before the step.

    For a result that is not finite: some rank's gradient or memory held inf or NaN. The
    result, reduced, is the same on every rank, so every rank comes here, and a loss scaler
    sees inf/NaN exactly where plain allreduce puts them. A follow-up collective: call it in
    the issuer's slot. A memory that was not finite is reset, with a warning.
    """
    memory = step.state.memory
    for key, t in zip(step.vector_keys, step.vectors):
        memory.withdraw_(key, t)
    for m in step.matrices:
        if m.compensated:
            memory.withdraw_(m.key, m.view)
        if m.absorbed is not None:
            memory.roll_back_(m.absorbed)
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
    for matrices in kinds:
        if len(matrices) > 1:
            stack = step.made(torch.stack([m.view for m in matrices]))
        else:
            stack = matrices[0].view.unsqueeze(0)
        step.batches.append(Batch(matrices, stack))


def known_shape(b: Batch) -> Shape:
    """The factor a step starts from: ``P`` (B, n, r) for a Q step, else ``Q`` (B, m, r)."""
    count, n, m = b.stack.shape
    return (count, n, b.matrices[0].rank) if b.refines_q else (count, m, b.matrices[0].rank)


def sent_shape(b: Batch) -> Shape:
    """The factor a step computes and sends first: ``Q`` for a Q step, else ``P``."""
    count, n, m = b.stack.shape
    return (count, m, b.matrices[0].rank) if b.refines_q else (count, n, b.matrices[0].rank)


def lay_out_known(step: BucketStep) -> torch.Tensor:
    """A flat buffer for the factor each batch starts from, each batch's ``known`` a view."""
    flat = step.new_flat(sum(math.prod(known_shape(b)) for b in step.batches))
    for b, view in zip(step.batches, _views(step.batches, flat, known_shape, starts_from_q)):
        b.known = view
    return flat


def sent_numel(step: BucketStep) -> int:
    return sum(math.prod(sent_shape(b)) for b in step.batches)


def lay_out_sent(step: BucketStep, flat: torch.Tensor) -> None:
    """Each batch's ``sent`` factor, a view into ``flat`` (of :func:`sent_numel` elements)."""
    for b, view in zip(step.batches, _views(step.batches, flat, sent_shape, sends_q)):
        b.sent = view


def _views(
    batches: list[Batch],
    flat: torch.Tensor,
    shape_of: Callable[[Batch], Shape],
    is_q: Callable[[Batch], bool],
) -> list[torch.Tensor]:
    views, offset = [], 0
    for b in batches:
        shape = shape_of(b)
        views.append(factor_view(flat[offset : offset + math.prod(shape)], shape, is_q(b)))
        offset += math.prod(shape)
    return views


def factor_view(flat: torch.Tensor, shape: Shape, is_q: bool) -> torch.Tensor:
    """A ``(batch, rows, rank)`` factor; ``Q`` factors are stored as ``Qᵀ`` (rank x rows).

    With ``Qᵀ`` contiguous, ``M Q``, ``Mᵀ P`` (computed as ``(Pᵀ M)ᵀ``) and ``P Qᵀ`` all read ``M``
    row by row; CPU BLAS is several times slower on an n x 2 right-hand side stored row-major.
    """
    if not is_q:
        return flat.view(shape)
    batch, rows, rank = shape
    return flat.view(batch, rank, rows).transpose(1, 2)


def starts_from_q(b: Batch) -> bool:
    """Whether the factor a batch starts from is a ``Q``: it is, except on a Q step."""
    return not b.refines_q


def sends_q(b: Batch) -> bool:
    """Whether the factor a batch sends first is a ``Q``: only on a Q step."""
    return b.refines_q


# -- the factors -------------------------------------------------------------------------------
def start_factors(step: BucketStep, known: torch.Tensor) -> None:
    """Fill each batch's starting factor: the stored one (warm start) or a random projection.

    A bucket call that needs any random projection draws one seed from the state's numpy
    generator and samples, in batch order, on a private CPU generator: the same values on
    every rank, PyTorch's sequence, and the global RNG untouched. A call draws its seed
    wherever PyTorch's hook does (every step without warm start, and on the first step that
    compresses), even with nothing to sample, so that every later bucket draws the seed it
    would draw there: a bucket of vectors only still takes its turn.
    """
    state, settings = step.state, step.state.settings
    warm = settings.warm_start or settings.single_round
    first = state.iter == settings.start_powerSGD_iter
    gen = _seeded(state) if not warm or first else None
    for b in step.batches:
        shape = known_shape(b)
        which = P_STEP if b.refines_q else Q_STEP
        stored = [
            state.factors.start(which, m.key, shape[1:], known) if warm else None
            for m in b.matrices
        ]
        if any(t is None for t in stored) and gen is None:
            gen = _seeded(state)
        if all(t is None for t in stored):
            b.known.copy_(torch.randn(shape, generator=gen, dtype=known.dtype))
            continue
        for i, t in enumerate(stored):
            if t is None:
                t = torch.randn((1, *shape[1:]), generator=gen, dtype=known.dtype)
            b.known[i].copy_(t.reshape(shape[1:]))
    orthogonalize_all(step, known, known_shape, starts_from_q)


def _seeded(state: PowerSGDState) -> torch.Generator:
    return torch.Generator().manual_seed(int(state.rng.randint(1_000_000_000)))


def orthogonalize_all(
    step: BucketStep,
    flat: torch.Tensor,
    shape_of: Callable[[Batch], Shape],
    is_q: Callable[[Batch], bool],
) -> None:
    """Orthogonalise every batch's factor in ``flat``, laid out one batch after another.

    Consecutive batches whose factors have the same shape and layout are one stack in
    ``flat``: they are orthogonalised with one batched call each (a bucket's layers mostly
    share a few widths), which saves many small per-layer operations on the critical path.
    """
    runs: list[list[int]] = []  # [start, end, batch, rows, rank, is_q]
    offset = 0
    for b in step.batches:
        count, rows, rank = shape_of(b)
        end, q = offset + count * rows * rank, int(is_q(b))
        last = runs[-1] if runs else None
        if last is not None and last[1] == offset and last[3:] == [rows, rank, q]:
            last[1], last[2] = end, last[2] + count
        else:
            runs.append([offset, end, count, rows, rank, q])
        offset = end
    # The single-round variant has numerics of its own: it takes the faster QR.
    method = "qr" if step.state.settings.single_round else "auto"
    epsilon = step.state.settings.orthogonalization_epsilon
    for start, end, count, rows, rank, q in runs:
        stack = factor_view(flat[start:end], (count, rows, rank), bool(q))
        lowrank.orthogonalize_(stack, epsilon, method)


def sent_factor(step: BucketStep, b: Batch) -> None:
    """``P = M Q``, or ``Q = Mᵀ P`` on a Q step: from the batch's known factor into ``sent``."""
    if b.refines_q:
        lowrank.right_factor_into(b.stack, b.known, b.sent)
    else:
        exact = not step.state.settings.single_round
        lowrank.left_factor_into(b.stack, b.known, b.sent, exact=exact)


def decompress(step: BucketStep, b: Batch, p: torch.Tensor, q: torch.Tensor) -> None:
    """Write ``P Qᵀ`` into each matrix of ``b``; remember ``M - P Qᵀ`` as its error."""
    memory = step.state.memory if step.state.settings.use_error_feedback else None
    for i, m in enumerate(b.matrices):
        error = memory.slot(m.key, m.view) if memory is not None else None
        # Q factors are stored as Qᵀ, so q[i].t() is the contiguous (rank, cols) matrix.
        lowrank.reconstruct_(b.stack[i], p[i], q[i].t(), error, step.scratch())
        if b.stacked:
            m.view.copy_(b.stack[i])
