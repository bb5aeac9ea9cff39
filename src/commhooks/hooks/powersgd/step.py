"""One bucket's PowerSGD step: the matrices in batches, their factors, the two pipelines.

A hook turns a bucket into a :class:`BucketStep` (which gradients are matrices to compress,
which are sent as they are) and runs :func:`two_rounds` (the paper's step) or
:func:`one_round`. Each reads as the algorithm: add the remembered error, form the factor to
send, sum it, orthogonalise, form the other factor, sum it, approximate, remember the error.

Factors of all the bucket's matrices live in flat buffers, one batch after another, so that one
collective carries them all; a batch's factor is a ``(batch, rows, rank)`` view of such a
buffer, and consecutive batches of one factor shape are orthogonalised with one call.

Non-finite sums: nothing is read back. The result is whatever the collectives give (inf or NaN
where plain allreduce has them), and the memories and factors are updated with
``torch.where`` on one flag reduced from the sums on the device, so that a step that is not
finite leaves them as they were.

Hook modules must not use ``from __future__ import annotations``: DDP rejects string annotations.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from commhooks import comm
from commhooks.compress import lowrank
from commhooks.compress.error_feedback import Key
from commhooks.compress.factors import P_STEP, Q_STEP

from .state import PowerSGDState

__all__ = ["Batch", "BucketStep", "Matrix", "one_round", "two_rounds"]

Future = torch.futures.Future


@dataclass
class Matrix:
    """A gradient of the bucket compressed as a matrix ``M`` (n x m)."""

    key: Key
    view: torch.Tensor  # (n, m): where M is formed and the approximation written
    rank: int
    step: str  # factors.BOTH, or the one factor a single-round step refines


@dataclass
class Batch:
    """Matrices of one shape, rank and step, compressed with batched products (or one alone)."""

    matrices: list[Matrix]
    stack: torch.Tensor  # (B, n, m): the one matrix's view, or a stacked copy of M
    known: torch.Tensor = field(init=False)  # (B, ., r): the factor the step starts from
    sent: torch.Tensor = field(init=False)  # (B, ., r): the factor it forms and sends first

    @property
    def refines_q(self) -> bool:
        """A single-round step that forms ``Q = Mᵀ P`` from the last ``P``."""
        return self.matrices[0].step == Q_STEP

    def shapes(self) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """``(known, sent)`` factor shapes: ``Q`` (B, m, r) then ``P`` (B, n, r), or the
        other way round on a Q step."""
        count, n, m = self.stack.shape
        p, q = (count, n, self.matrices[0].rank), (count, m, self.matrices[0].rank)
        return (p, q) if self.refines_q else (q, p)

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(P, Q)`` of the batch."""
        return (self.known, self.sent) if self.refines_q else (self.sent, self.known)


@dataclass
class BucketStep:
    """Everything one hook call needs, from its first collective to its result."""

    state: PowerSGDState
    bucket: Any
    buffer: torch.Tensor  # what the hook's future resolves to
    group: dist.ProcessGroup
    matrices: list[Matrix]
    vectors: list[torch.Tensor]  # sent as they are (vectors, small matrices)
    vector_keys: list[Key]
    writeback: Callable[[], object] | None = None  # copies the matrices' results into buffer
    batches: list[Batch] = field(default_factory=list)
    send: torch.Tensor = field(init=False)  # the vectors, then every batch's sent factor
    known: torch.Tensor = field(init=False)  # every batch's known factor
    starts: torch.Tensor | None = None  # a copy of ``known`` as it started, to keep from
    made: list[torch.Tensor] = field(default_factory=list)  # tensors made on DDP's stream

    def vector_numel(self) -> int:
        return sum(t.numel() for t in self.vectors)

    def write_back(self) -> torch.Tensor:
        """Finish: the bucket holds the result. Tensors made on DDP's stream and last used
        here, in a callback's stream on a GPU, are marked so that their memory is not reused
        before that stream's kernels ran."""
        if self.writeback is not None:
            self.writeback()
        comm.used_on_current_stream(self.made)
        return self.buffer


# -- the two pipelines ---------------------------------------------------------------------------
def two_rounds(step: BucketStep) -> "Future[torch.Tensor]":
    """One power iteration per matrix ``M`` (gradient plus remembered error), as in the paper.

    ``Q`` is the last step's (warm start) or random, orthogonalised; ``P = M Q`` is summed with
    the vectors in one collective, issued here on DDP's thread; then, in the state's issuer
    (in slot order, whatever thread completes the sum), ``P`` is orthogonalised, ``Q = Mᵀ P``
    formed and averaged; ``M ≈ P Qᵀ`` and ``M - P Qᵀ`` is remembered.
    """
    _prepare(step, single=False)
    unc = step.vector_numel()
    for b in step.batches:  # P = M Q
        torch.bmm(b.stack, b.known, out=b.sent)
    first = comm.allreduce(step.send, step.group)
    issuer = step.state.issuer
    devices = comm.future_devices(step.buffer)
    q_sum = issuer.then(first, lambda summed: _second_round(step, unc), devices)
    return comm.then(q_sum, lambda done: _finish_two(step, done, unc))


def _second_round(step: BucketStep, unc: int) -> "Future[torch.Tensor]":
    """In the issuer's turn, with ``P`` summed: orthogonalise it, form ``Q = Mᵀ P`` over the
    starting ``Q``, and sum ``Q`` on the issuer's group."""
    eps = step.state.settings.orthogonalization_epsilon
    for stack in _runs(step.send[unc:], [b.shapes()[1] for b in step.batches]):
        lowrank.orthogonalize_(stack, eps)
    for b in step.batches:
        torch.bmm(b.stack.transpose(1, 2), b.sent, out=b.known)
    return comm.allreduce(step.known, step.state.issuer.group)


def _finish_two(step: BucketStep, done: "Future[torch.Tensor]", unc: int) -> torch.Tensor:
    """With ``Q`` summed: average it, approximate, remember the errors and keep ``Q``."""
    q = done.wait()
    world = step.group.size()
    q.div_(world)
    step.send[:unc].div_(world)
    finite = torch.isfinite(step.send[:unc]).all() & torch.isfinite(q).all()
    _take_vectors(step, finite)
    _approximate(step, finite)
    if step.state.settings.warm_start:
        _keep_known(step, finite)
    return step.write_back()


def one_round(step: BucketStep) -> "Future[torch.Tensor]":
    """One factor per matrix and step, alternately ``P = M Q`` and ``Q = Mᵀ P`` from the other
    factor of the last step (orthogonalised), averaged with the vectors in one collective;
    then ``M ≈ P Qᵀ`` and both factors are kept."""
    _prepare(step, single=True)
    for b in step.batches:
        m = b.stack.transpose(1, 2) if b.refines_q else b.stack
        torch.bmm(m, b.known, out=b.sent)
    world = step.group.size()
    averaged = comm.allreduce_then(step.send, step.group, lambda s: s.div_(world))
    return comm.then(averaged, lambda done: _finish_one(step, done))


def _finish_one(step: BucketStep, done: "Future[torch.Tensor]") -> torch.Tensor:
    sent = done.wait()
    finite = torch.isfinite(sent).all()
    old = _old_sent(step)
    _take_vectors(step, finite)
    _approximate(step, finite)
    shapes = [b.shapes()[1] for b in step.batches]
    kept = _kept(finite, sent[step.vector_numel() :], old, shapes)
    assert step.starts is not None, "the single round needs warm start"
    known_shapes = [b.shapes()[0] for b in step.batches]
    known = torch.where(finite, step.known, step.starts)
    factors = step.state.factors
    for b, sent_b, known_b in zip(step.batches, _views(kept, shapes), _views(known, known_shapes)):
        for m, k, s in zip(b.matrices, known_b.unbind(0), sent_b.unbind(0)):
            p, q = (k, s) if b.refines_q else (s, k)
            factors.keep(m.key, p, q, m.step)
    return step.write_back()


# -- the stages ----------------------------------------------------------------------------------
def _prepare(step: BucketStep, single: bool) -> None:
    """Add the remembered errors, batch the matrices, lay out the factors and fill the ones
    each batch starts from, orthogonalised; the vectors are packed at the front of ``send``."""
    settings = step.state.settings
    if settings.use_error_feedback:
        keys = [*step.vector_keys, *(m.key for m in step.matrices)]
        step.state.memory.compensate_all_(keys, [*step.vectors, *(m.view for m in step.matrices)])
    _form_batches(step)
    _lay_out(step)
    lowrank.pack_into(step.vectors, step.send)
    _fill_starts(step)
    if settings.warm_start:  # what a step that is not finite keeps
        step.starts = step.known.clone()
    method = "qr" if single else "auto"  # the single round's own numerics: the faster QR
    eps = settings.orthogonalization_epsilon
    for stack in _runs(step.known, [b.shapes()[0] for b in step.batches]):
        lowrank.orthogonalize_(stack, eps, method)


def _form_batches(step: BucketStep) -> None:
    """One batch per kind (shape, rank, step) with ``batch_tensors_with_same_shape``, else one
    per matrix; a batch of several holds a stacked copy of its matrices, written back later."""
    together = step.state.settings.batch_tensors_with_same_shape
    kinds: dict[tuple[object, ...], list[Matrix]] = {}
    for m in step.matrices:
        kind = (tuple(m.view.shape), m.rank, m.step) if together else (id(m),)
        kinds.setdefault(kind, []).append(m)
    for matrices in kinds.values():
        views = [m.view for m in matrices]
        stack = views[0].unsqueeze(0) if len(views) == 1 else torch.stack(views)
        if len(views) > 1:
            step.made.append(stack)
        step.batches.append(Batch(matrices, stack))


def _lay_out(step: BucketStep) -> None:
    """Flat buffers for the factors: ``known`` (what each batch starts from) and ``send`` (the
    vectors, then what each batch forms first), with each batch's views of them."""
    unc = step.vector_numel()
    known_shapes = [b.shapes()[0] for b in step.batches]
    sent_shapes = [b.shapes()[1] for b in step.batches]
    new = step.buffer.new_empty
    step.known = new(sum(math.prod(s) for s in known_shapes))
    step.send = new(unc + sum(math.prod(s) for s in sent_shapes))
    step.made += [step.known, step.send]
    for b, known, sent in zip(
        step.batches, _views(step.known, known_shapes), _views(step.send[unc:], sent_shapes)
    ):
        b.known, b.sent = known, sent


def _views(flat: torch.Tensor, shapes: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    """Consecutive views of ``flat`` of the given shapes."""
    out, at = [], 0
    for shape in shapes:
        size = math.prod(shape)
        out.append(flat[at : at + size].view(shape))
        at += size
    return out


def _runs(flat: torch.Tensor, shapes: list[tuple[int, int, int]]) -> list[torch.Tensor]:
    """Consecutive views of ``flat`` as :func:`_views`, where consecutive shapes that differ
    only in their batch size are joined into one stack (one orthogonalisation for many)."""
    runs: list[tuple[int, int, int]] = []
    for count, rows, rank in shapes:
        if runs and runs[-1][1:] == (rows, rank):
            runs[-1] = (runs[-1][0] + count, rows, rank)
        else:
            runs.append((count, rows, rank))
    return _views(flat, runs)


def _fill_starts(step: BucketStep) -> None:
    """Fill each batch's starting factor: the stored one (warm start) or a random projection.

    A call that needs any random projection draws one seed from the state's numpy generator
    and samples, batch by batch, on a private CPU generator: the same values on every rank,
    PyTorch's sequence, the global RNG untouched. The seed is drawn wherever PyTorch's hook
    draws one (every step without warm start, and at the first step that compresses), even
    with nothing to sample, so that later buckets draw the seeds they would draw there.
    """
    state, settings = step.state, step.state.settings
    warm = settings.warm_start or settings.single_round
    first = state.iter == settings.start_powerSGD_iter
    gen = _seeded(state) if not warm or first else None
    for b in step.batches:
        which = P_STEP if b.refines_q else Q_STEP
        shape = b.shapes()[0]
        stored = [
            state.factors.start(which, m.key, shape[1:], b.known) if warm else None
            for m in b.matrices
        ]
        if all(s is None for s in stored):  # one draw for the batch, as PyTorch's
            gen = gen or _seeded(state)
            b.known.copy_(torch.randn(shape, generator=gen, dtype=b.known.dtype))
            continue
        for i, s in enumerate(stored):
            if s is None:
                gen = gen or _seeded(state)
                s = torch.randn(shape[1:], generator=gen, dtype=b.known.dtype)
            b.known[i].copy_(s)


def _seeded(state: PowerSGDState) -> torch.Generator:
    return torch.Generator().manual_seed(int(state.rng.randint(1_000_000_000)))


def _take_vectors(step: BucketStep, finite: torch.Tensor) -> None:
    """The tensors sent as they are take their average; ``local - average`` is remembered."""
    if not step.vectors:
        return
    unc = step.vector_numel()
    average = step.send[:unc]
    if step.state.settings.use_error_feedback:
        errors = lowrank.pack_into(step.vectors, step.buffer.new_empty(unc)).sub_(average)
        step.state.memory.record_where(
            finite, step.vector_keys, lowrank.views_like(errors, step.vectors)
        )
    lowrank.unpack_from(average, step.vectors)


def _approximate(step: BucketStep, finite: torch.Tensor) -> None:
    """``P Qᵀ`` into each matrix; ``M - P Qᵀ`` remembered as its error where the step was
    finite (the memory as it was otherwise)."""
    memory = step.state.memory if step.state.settings.use_error_feedback else None
    for b in step.batches:
        p, q = b.factors()
        approx = torch.bmm(p, q.transpose(1, 2))
        if memory is not None:
            errors = b.stack - approx
            memory.record_where(finite, [m.key for m in b.matrices], list(errors.unbind(0)))
        torch._foreach_copy_([m.view for m in b.matrices], list(approx.unbind(0)))


def _keep_known(step: BucketStep, finite: torch.Tensor) -> None:
    """Keep each averaged ``Q`` for the next step's warm start (see :func:`_kept`): where the
    step was not finite, the ``Q`` it started from."""
    assert step.starts is not None, "two rounds with warm start keep a copy of the start"
    shapes = [b.shapes()[0] for b in step.batches]
    kept = _kept(finite, step.known, step.starts, shapes)
    factors = step.state.factors
    for b, q in zip(step.batches, _views(kept, shapes)):
        for m, factor in zip(b.matrices, q.unbind(0)):
            factors.keep(m.key, None, factor)


def _kept(
    finite: torch.Tensor, new: torch.Tensor, old: torch.Tensor, shapes: list[tuple[int, int, int]]
) -> torch.Tensor:
    """The factors to keep, laid out as ``new`` and ``old``: ``new`` where the step was finite,
    each all-zero column of it taken from ``old`` (a zero column would stay zero for good:
    ``M·0 = 0``); ``old`` where the step was not finite."""
    out = torch.empty_like(new)
    for fresh, before, into in zip(_runs(new, shapes), _runs(old, shapes), _runs(out, shapes)):
        torch.where(finite, lowrank.keep_nonzero_columns(fresh, before), before, out=into)
    return out


def _old_sent(step: BucketStep) -> torch.Tensor:
    """The single round's sent factors as stored before the step (zeros where none), laid out
    as ``send`` after the vectors: what a step that is not finite keeps."""
    unc = step.vector_numel()
    old = torch.zeros_like(step.send[unc:])
    factors = step.state.factors
    for b, view in zip(step.batches, _views(old, [b.shapes()[1] for b in step.batches])):
        which = Q_STEP if b.refines_q else P_STEP
        for i, m in enumerate(b.matrices):
            stored = factors.start(which, m.key, view.shape[1:], view)
            if stored is not None:
                view[i].copy_(stored)
    return old
