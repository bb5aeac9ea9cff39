"""One bucket's PowerSGD step: its layout, kept across steps, and the two pipelines.

A hook turns a bucket into a :class:`Layout` (which gradients are matrices, in which batches,
where every factor lives) and runs :func:`two_rounds` (the paper's step) or :func:`one_round`
on it, each read as the algorithm: add the error, form the factor to send, sum it,
orthogonalise, form the other, sum it, approximate, remember the error.

Factors live in flat buffers, one batch after another, so that one collective carries them
all; a batch's factor is a ``(batch, rows, rank)`` view, and consecutive batches of one shape
are orthogonalised with one call. A layout is kept while the bucket's buffer, parameters and
steps stay the same, so a step does not rebuild its buffers and views (a GPU's host pays each);
what a step makes is its few results' own tensors.

Nothing is read back: the result is what the collectives give (inf or NaN spread over a matrix,
as PyTorch's), and the memories and factors are updated with ``torch.where`` on one flag
reduced on the device, so that a step that is not finite leaves them as they were.

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
from commhooks.compress.error_feedback import Key, all_finite
from commhooks.compress.factors import P_STEP, Q_STEP

from .state import PowerSGDState

__all__ = ["Batch", "BucketStep", "Layout", "Matrix", "lay_out", "one_round", "two_rounds"]

Future = torch.futures.Future
Shape = tuple[int, int, int]


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
    stack: torch.Tensor  # (B, n, m): the one matrix's view, or a copy of M, stacked
    known: torch.Tensor = field(init=False)  # (B, ., r): the factor the step starts from
    sent: torch.Tensor = field(init=False)  # (B, ., r): the factor it forms and sends first
    known_each: list[torch.Tensor] = field(init=False)  # each matrix's view of ``known``

    @property
    def stacked(self) -> bool:
        return len(self.matrices) > 1

    @property
    def refines_q(self) -> bool:
        """A single-round step that forms ``Q = Mᵀ P`` from the last ``P``."""
        return self.matrices[0].step == Q_STEP

    def shapes(self) -> tuple[Shape, Shape]:
        """``(known, sent)``: ``Q`` (B, m, r) then ``P`` (B, n, r), the other way round on a
        Q step."""
        count, n, m = self.stack.shape
        rank = self.matrices[0].rank
        p, q = (count, n, rank), (count, m, rank)
        return (p, q) if self.refines_q else (q, p)

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(P, Q)`` of the batch."""
        return (self.known, self.sent) if self.refines_q else (self.sent, self.known)


@dataclass
class Layout:
    """Where a bucket's step works, made once (:func:`lay_out`): ``send`` holds the tensors
    sent as they are, then every batch's sent factor; ``known`` every batch's starting factor;
    ``starts`` ``known`` as the step began, which a step that is not finite keeps."""

    signature: tuple[object, ...]
    batches: list[Batch]
    vectors: list[torch.Tensor]
    vector_keys: list[Key]
    whole: torch.Tensor  # ``send`` then ``known``, one flat buffer
    send: torch.Tensor
    known: torch.Tensor
    starts: torch.Tensor = field(init=False)
    unc: int = field(init=False)  # elements sent as they are, at the front of ``send``
    averages: list[torch.Tensor] = field(init=False)  # ``send``'s views shaped as the vectors
    known_runs: list[torch.Tensor] = field(init=False)  # stacks orthogonalised at once
    start_runs: list[torch.Tensor] = field(init=False)  # ``starts``, laid out alike
    sent_runs: list[torch.Tensor] = field(init=False)

    def __post_init__(self) -> None:
        self.starts = torch.empty_like(self.known)
        self.unc = unc = sum(v.numel() for v in self.vectors)
        known_shapes = [b.shapes()[0] for b in self.batches]
        sent_shapes = [b.shapes()[1] for b in self.batches]
        for b, known, sent in zip(
            self.batches, _views(self.known, known_shapes), _views(self.send[unc:], sent_shapes)
        ):
            b.known, b.sent, b.known_each = known, sent, list(known.unbind(0))
        self.averages = lowrank.views_like(self.send, self.vectors)
        self.known_runs = _views(self.known, _runs(known_shapes))
        self.start_runs = _views(self.starts, _runs(known_shapes))
        self.sent_runs = _views(self.send[unc:], _runs(sent_shapes))


def lay_out(
    signature: tuple[object, ...],
    matrices: list[Matrix],
    vectors: list[torch.Tensor],
    vector_keys: list[Key],
    together: bool,
) -> Layout:
    """The layout of a bucket: batches of one kind (shape, rank and step) if ``together``,
    else one a matrix, and the flat buffers of their factors."""
    kinds: dict[tuple[object, ...], list[Matrix]] = {}
    for m in matrices:
        kind = (tuple(m.view.shape), m.rank, m.step) if together else (id(m),)
        kinds.setdefault(kind, []).append(m)
    batches = []
    for group in kinds.values():
        views = [m.view for m in group]
        stack = views[0].unsqueeze(0) if len(views) == 1 else torch.stack(views)
        batches.append(Batch(group, stack))
    like = matrices[0].view if matrices else vectors[0]
    known_numel = sum(math.prod(b.shapes()[0]) for b in batches)
    sent_numel = sum(math.prod(b.shapes()[1]) for b in batches)
    unc = sum(v.numel() for v in vectors)
    # One buffer, ``send`` then ``known``: the step's finiteness is one sum of it.
    whole = like.new_zeros(unc + sent_numel + known_numel)
    send, known = whole[: unc + sent_numel], whole[unc + sent_numel :]
    return Layout(signature, batches, vectors, vector_keys, whole, send, known)


def _views(flat: torch.Tensor, shapes: list[Shape]) -> list[torch.Tensor]:
    """Consecutive views of ``flat``, ``(batch, rows, rank)`` each, stored a column after
    another (``(batch, rank, rows)`` in memory). A CPU's BLAS forms ``M Q`` and ``Mᵀ P`` five
    to ten times faster when the thin factor's columns are contiguous; a GPU's takes either."""
    out, at = [], 0
    for count, rows, rank in shapes:
        size = count * rows * rank
        out.append(flat[at : at + size].view(count, rank, rows).transpose(1, 2))
        at += size
    return out


def _runs(shapes: list[Shape]) -> list[Shape]:
    """``shapes``, consecutive ones that differ only in their batch size joined: one stack, one
    orthogonalisation for many matrices."""
    runs: list[Shape] = []
    for count, rows, rank in shapes:
        if runs and runs[-1][1:] == (rows, rank):
            runs[-1] = (runs[-1][0] + count, rows, rank)
        else:
            runs.append((count, rows, rank))
    return runs


@dataclass
class BucketStep:
    """One hook call: its bucket, group and layout, and what writes the result back."""

    state: PowerSGDState
    bucket: Any
    buffer: torch.Tensor  # what the hook's future resolves to
    group: dist.ProcessGroup
    layout: Layout
    writeback: Callable[[], object] | None = None  # copies the matrices' results into buffer

    def write_back(self) -> torch.Tensor:
        """Finish: the bucket holds the result. The layout's buffers were last used here, in
        a callback's stream on a GPU: marked so, their memory is not reused too early."""
        if self.writeback is not None:
            self.writeback()
        layout = self.layout
        comm.used_on_current_stream([layout.whole, layout.starts])
        return self.buffer


# -- the two pipelines ---------------------------------------------------------------------------
def two_rounds(step: BucketStep) -> "Future[torch.Tensor]":
    """One power iteration per matrix ``M``, as in the paper: ``P = M Q`` summed with the
    vectors here, on DDP's thread; in the state's issuer ``P`` orthogonalised and ``Q = Mᵀ P``
    averaged; ``M ≈ P Qᵀ``, and ``M - P Qᵀ`` remembered."""
    layout = _prepare(step, single=False)
    for b in layout.batches:  # P = M Q
        torch.bmm(b.stack, b.known, out=b.sent)
    first = comm.allreduce(layout.send, step.group)
    issuer = step.state.issuer
    q_sum = issuer.then(first, lambda _: _second_round(step), comm.future_devices(step.buffer))
    return comm.then(q_sum, lambda done: _finish_two(step, done))


def _second_round(step: BucketStep) -> "Future[torch.Tensor]":
    """With ``P`` summed: orthogonalise it, form ``Q = Mᵀ P`` and sum it on the issuer's group."""
    layout, eps = step.layout, step.state.settings.orthogonalization_epsilon
    for stack in layout.sent_runs:
        lowrank.orthogonalize_(stack, eps)
    for b in layout.batches:
        torch.bmm(b.stack.transpose(1, 2), b.sent, out=b.known)
    return comm.allreduce(layout.known, step.state.issuer.group)


def _finish_two(step: BucketStep, done: "Future[torch.Tensor]") -> torch.Tensor:
    """With ``Q`` summed: average it, approximate, remember the errors and keep ``Q``."""
    q, layout = done.wait(), step.layout
    world = comm.size(step.group)
    q.div_(world)
    vectors = layout.send[: layout.unc]
    vectors.div_(world)
    finite = all_finite(layout.whole)  # P is finite where Q = Mᵀ P is
    _take_vectors(step, finite)
    _approximate(step, finite)
    if step.state.settings.warm_start:
        _keep_known(step, finite)
    return step.write_back()


def one_round(step: BucketStep) -> "Future[torch.Tensor]":
    """One factor per matrix and step, alternately ``P = M Q`` and ``Q = Mᵀ P`` from the other
    factor of the last step (orthogonalised), averaged with the vectors in one collective;
    then ``M ≈ P Qᵀ`` and both factors are kept."""
    layout = _prepare(step, single=True)
    for b in layout.batches:
        m = b.stack.transpose(1, 2) if b.refines_q else b.stack
        torch.bmm(m, b.known, out=b.sent)
    world = comm.size(step.group)
    averaged = comm.allreduce_then(layout.send, step.group, lambda s: s.div_(world))
    return comm.then(averaged, lambda done: _finish_one(step, done))


def _finish_one(step: BucketStep, done: "Future[torch.Tensor]") -> torch.Tensor:
    sent, layout = done.wait(), step.layout
    finite = all_finite(sent)
    _take_vectors(step, finite)
    _approximate(step, finite)
    kept_sent = _kept(finite, sent[layout.unc :], _old_sent(step), layout.batches)
    kept_known = torch.where(finite, layout.known, layout.starts)
    factors = step.state.factors
    shapes = [b.shapes() for b in layout.batches]
    for b, known, fresh in zip(
        layout.batches,
        _views(kept_known, [s[0] for s in shapes]),
        _views(kept_sent, [s[1] for s in shapes]),
    ):
        for m, k, s in zip(b.matrices, known.unbind(0), fresh.unbind(0)):
            p, q = (k, s) if b.refines_q else (s, k)
            factors.keep(m.key, p, q, m.step)
    return step.write_back()


# -- the stages ----------------------------------------------------------------------------------
def _prepare(step: BucketStep, single: bool) -> Layout:
    """Add the remembered errors, pack the vectors at the front of ``send``, fill the stacked
    copies and the factors each batch starts from (kept as ``starts``), orthogonalised."""
    layout, settings = step.layout, step.state.settings
    if settings.use_error_feedback:
        matrices = [m for b in layout.batches for m in b.matrices]
        keys = [*layout.vector_keys, *(m.key for m in matrices)]
        memory = step.state.memory
        if memory.awaits_check and step.state.meets_every_tensor_each_step:  # after a load
            for key in memory.forget_unmet(step.state.iter):
                step.state.factors.drop(key)  # warm starts of a tensor compressed no more
        memory.compensate_all_(keys, [*layout.vectors, *(m.view for m in matrices)])
    if layout.vectors:
        torch._foreach_copy_(layout.averages, layout.vectors)
    for b in layout.batches:
        if b.stacked:  # a copy of M, now formed
            torch.stack([m.view for m in b.matrices], out=b.stack)
    _fill_starts(step)
    if settings.warm_start or single:  # what a step that is not finite keeps
        layout.starts.copy_(layout.known)
    method = "qr" if single else "auto"  # the single round's own numerics: the faster QR
    for stack in layout.known_runs:
        lowrank.orthogonalize_(stack, settings.orthogonalization_epsilon, method)
    return layout


def _fill_starts(step: BucketStep) -> None:
    """Fill each batch's starting factor: the stored one (warm start; a two-round ``Q`` is
    stored where it is formed), or a random projection, from one seed of the state's numpy
    generator on a private CPU generator: the same on every rank, PyTorch's sequence. The seed
    is drawn wherever PyTorch's hook draws one, even with nothing to sample, so that later
    buckets draw the seeds they would."""
    state, settings = step.state, step.state.settings
    warm = settings.warm_start or settings.single_round
    first = state.iter == settings.start_powerSGD_iter
    gen = _seeded(state) if not warm or first else None
    for b in step.layout.batches:
        which = P_STEP if b.refines_q else Q_STEP
        store = state.factors.p if b.refines_q else state.factors.q
        stored = [store.get(m.key) if warm else None for m in b.matrices]
        if all(s is view for s, view in zip(stored, b.known_each)):
            continue  # where the last step left them
        shape = b.shapes()[0]
        stored = [
            state.factors.start(which, m.key, shape[1:], b.known) if warm else None
            for m in b.matrices
        ]
        if all(s is None for s in stored):  # one draw for the batch, as PyTorch's
            gen = gen or _seeded(state)
            b.known.copy_(torch.randn(shape, generator=gen, dtype=b.known.dtype))
            continue
        for view, s in zip(b.known_each, stored):
            if s is None:
                gen = gen or _seeded(state)
                s = torch.randn(shape[1:], generator=gen, dtype=b.known.dtype)
            view.copy_(s)


def _seeded(state: PowerSGDState) -> torch.Generator:
    return torch.Generator().manual_seed(int(state.rng.randint(1_000_000_000)))


def _take_vectors(step: BucketStep, finite: torch.Tensor) -> None:
    """The tensors sent as they are take their average; ``local - average`` is remembered."""
    layout = step.layout
    if not layout.vectors:
        return
    if step.state.settings.use_error_feedback:
        errors = torch._foreach_sub(layout.vectors, layout.averages)
        step.state.memory.record_where(finite, layout.vector_keys, errors)
    torch._foreach_copy_(layout.vectors, layout.averages)


def _approximate(step: BucketStep, finite: torch.Tensor) -> None:
    """``P Qᵀ`` into each matrix; ``M - P Qᵀ`` remembered as its error where the step was
    finite (the memory as it was otherwise). The error is formed in ``M``'s own place and the
    approximation written over it: three passes over the bucket and no buffer of its size."""
    memory = step.state.memory if step.state.settings.use_error_feedback else None
    for b in step.layout.batches:
        p, q = b.factors()
        if memory is not None:
            b.stack.baddbmm_(p, q.transpose(1, 2), alpha=-1)
            memory.record_where(finite, [m.key for m in b.matrices], b.stack.unbind(0))
        torch.bmm(p, q.transpose(1, 2), out=b.stack)
        if b.stacked:
            torch._foreach_copy_([m.view for m in b.matrices], list(b.stack.unbind(0)))


def _keep_known(step: BucketStep, finite: torch.Tensor) -> None:
    """Keep each averaged ``Q`` where it was formed, for the next step's warm start: any zero
    column (``M·0 = 0``: zero for good) taken from the step's start; the start itself where
    the step was not finite."""
    layout = step.layout
    for fresh, before in zip(layout.known_runs, layout.start_runs):
        torch.where(finite, lowrank.keep_nonzero_columns(fresh, before), before, out=fresh)
    factors = step.state.factors
    for b in layout.batches:
        for m, factor in zip(b.matrices, b.known_each):
            factors.keep(m.key, None, factor)


def _kept(
    finite: torch.Tensor, new: torch.Tensor, old: torch.Tensor, batches: list[Batch]
) -> torch.Tensor:
    """:func:`_keep_known` for the sent factors laid out as ``new`` and ``old``, into a new
    tensor."""
    out = torch.empty_like(new)
    shapes = _runs([b.shapes()[1] for b in batches])
    for fresh, before, into in zip(_views(new, shapes), _views(old, shapes), _views(out, shapes)):
        torch.where(finite, lowrank.keep_nonzero_columns(fresh, before), before, out=into)
    return out


def _old_sent(step: BucketStep) -> torch.Tensor:
    """The single round's sent factors as stored before the step (zeros where none), laid out
    as ``send``'s: what a step that is not finite keeps."""
    layout = step.layout
    old = torch.zeros_like(layout.send[layout.unc :])
    factors = step.state.factors
    for b, view in zip(layout.batches, _views(old, [b.shapes()[1] for b in layout.batches])):
        which = Q_STEP if b.refines_q else P_STEP
        for i, m in enumerate(b.matrices):
            stored = factors.start(which, m.key, view.shape[1:], view)
            if stored is not None:
                view[i].copy_(stored)
    return old
