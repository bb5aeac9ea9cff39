"""One bucket's PowerSGD compression as named steps: two rounds (P, then Q) or one.

The hooks in :mod:`commhooks.hooks.powersgd` build a :class:`_Call` and hand it to
:func:`run`. Matrices are compressed with the routines of :mod:`commhooks.lowrank`. With one
bucket all of this runs after backward, on the critical path of the step, so passes over the
gradients are fused where that is faster: the reconstruction and the new error in one blocked
pass for the two-round variant.

The single-round variant keeps its error memory lazily (see ``PowerSGDState._materialize``):
one pass before its collective adds the gradient into the memory and forms the factor (every
few steps it also subtracts the approximations sent since); after the collective, one pass
writes ``P Qᵀ`` into the gradient. The two-round variant needs three: compensate and multiply,
multiply, and write both the approximation and the new error.

Hook modules must not use ``from __future__ import annotations``: DDP rejects string annotations.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from commhooks import comm, lowrank
from commhooks.hooks._powersgd_state import _P_STEP, _Q_STEP, Key, PowerSGDState

__all__ = ["reads_back_checks", "run", "single_round_step"]


# ----------------------------------------------------------------------------------------------
# One bucket's compression, as named steps
# ----------------------------------------------------------------------------------------------
@dataclass
class _Entry:
    key: Key
    matrix: torch.Tensor  # (n, m): where M is built and the approximation is written
    rank: int
    step: str
    error_in_matrix: bool = False  # the remembered error was added to a gradient view
    # Single round, a matrix compressed on its own: its memory (the error, plus the products
    # in ``pending`` that are still to subtract), into which the gradient is added.
    memory: torch.Tensor | None = None
    pending: tuple[torch.Tensor, torch.Tensor] | None = None  # stacked (P, Qᵀ) to subtract
    folds: bool = False  # this step subtracts ``pending`` from the memory
    written: int = 0  # rows of the memory that now hold gradient + previous error
    created: bool = False  # the memory was made for it this step


@dataclass
class _Group:
    """Entries of one shape and step, compressed with one batched product (or one entry)."""

    entries: list[_Entry]
    stack: torch.Tensor  # (B, n, m): a view of the single entry's matrix, or a stacked copy
    known: torch.Tensor | None = None  # the factor the step starts from, (B, ., r)
    sent: torch.Tensor | None = None  # the factor the step sends, a view into a send buffer

    @property
    def stacked(self) -> bool:
        return len(self.entries) > 1


@dataclass
class _Call:
    """Everything one hook call needs after its collectives complete."""

    state: PowerSGDState
    bucket: dist.GradBucket
    buffer: torch.Tensor
    group: dist.ProcessGroup
    entries: list[_Entry]
    uncompressed: list[torch.Tensor]
    uncompressed_keys: list[Key] = field(default_factory=list)
    writeback: Callable[[], None] | None = None
    groups: list[_Group] = field(default_factory=list)
    starts: list[torch.Tensor] = field(default_factory=list)  # each group's Q before the step
    _scratch: torch.Tensor | None = None

    def scratch(self) -> torch.Tensor:
        """One block's worth of working memory for the blocked products, made once per call."""
        if self._scratch is None:
            sizes = (lowrank.scratch_elements(g.stack[0], g.entries[0].rank) for g in self.groups)
            self._scratch = torch.empty(
                max(sizes, default=0),
                dtype=self.buffer.dtype,
                device=self.buffer.device,
            )
        return self._scratch


def _compensate_uncompressed(call: _Call) -> None:
    """Add the remembered error to each tensor sent as it is."""
    state = call.state
    if not state.use_error_feedback:
        return
    for key, t in zip(call.uncompressed_keys, call.uncompressed):
        error = state._explicit_error(key, tuple(t.shape), t)
        if error is not None:
            t.add_(error)


def _compensate_matrices(call: _Call, entries: list[_Entry]) -> None:
    """Add the remembered error to each matrix in place, so M = gradient + previous error."""
    state = call.state
    if not state.use_error_feedback:
        return
    for e in entries:
        error = state._explicit_error(e.key, tuple(e.matrix.shape), e.matrix)
        if error is not None:
            e.matrix.add_(error)
            e.error_in_matrix = True


def _attach_memory(call: _Call, e: _Entry) -> None:
    """Single round, a matrix on its own: find its memory, to read while forming the factor."""
    state = call.state
    if state.use_error_feedback:
        e.memory = state._stored(state._errors, e.key, tuple(e.matrix.shape), e.matrix)
        e.pending = state._pending_product(e.key)
        e.folds = state._fold_due(e.pending, e.rank)


def _kinds(call: _Call) -> list[list[_Entry]]:
    """Entries compressed together: of one shape, rank and step if batching, else alone."""
    batch = call.state.batch_tensors_with_same_shape
    by_kind: dict[tuple, list[_Entry]] = {}
    for e in call.entries:
        kind = (tuple(e.matrix.shape), e.rank, e.step) if batch else (id(e),)
        by_kind.setdefault(kind, []).append(e)
    return list(by_kind.values())


def _form_groups(call: _Call, kinds: list[list[_Entry]]) -> None:
    for entries in kinds:
        stack = (
            torch.stack([e.matrix for e in entries])
            if len(entries) > 1
            else entries[0].matrix.unsqueeze(0)
        )
        call.groups.append(_Group(entries, stack))


def _known_shape(g: _Group) -> tuple[int, int, int]:
    b, n, m = g.stack.shape
    rank = g.entries[0].rank
    return (b, n, rank) if g.entries[0].step == _Q_STEP else (b, m, rank)


def _sent_shape(g: _Group) -> tuple[int, int, int]:
    b, n, m = g.stack.shape
    rank = g.entries[0].rank
    return (b, m, rank) if g.entries[0].step == _Q_STEP else (b, n, rank)


def _prepare_known_factors(call: _Call, known: torch.Tensor) -> None:
    """Fill each group's starting factor: the stored one (warm start) or a random projection.

    A bucket call that needs any random projection draws one seed from the state's numpy
    generator and samples, in group order, on a private CPU generator: the same values on
    every rank, PyTorch's sequence, and the global RNG untouched. A call draws its seed
    wherever PyTorch's hook does (every step without warm start, and on the first step that
    compresses), even with nothing to sample, so that every later bucket draws the seed it
    would draw there: a bucket of vectors only still takes its turn.
    """
    state, offset = call.state, 0
    warm = state.warm_start or state.single_round
    gen = _seeded(state) if not warm or state.iter == state.start_powerSGD_iter else None
    for g in call.groups:
        shape = _known_shape(g)
        g.known = _factor_view(
            known[offset : offset + _numel(shape)], shape, is_q=g.entries[0].step != _Q_STEP
        )
        offset += _numel(shape)
        store = state.p_memory_dict if g.entries[0].step == _Q_STEP else state.q_memory_dict
        stored = [
            state._stored(store, e.key, shape[1:], known) if warm else None for e in g.entries
        ]
        missing = [i for i, t in enumerate(stored) if t is None]
        if missing and gen is None:
            gen = _seeded(state)
        if len(missing) == len(g.entries):
            g.known.copy_(torch.randn(shape, generator=gen, dtype=known.dtype))
        else:
            for i, t in enumerate(stored):
                if t is None:
                    t = torch.randn((1, *shape[1:]), generator=gen, dtype=known.dtype)
                g.known[i].copy_(t.reshape(shape[1:]))
    _orthogonalize_all(call, known, _known_shape, lambda g: g.entries[0].step != _Q_STEP)


def _seeded(state: PowerSGDState) -> torch.Generator:
    return torch.Generator().manual_seed(int(state.rng.randint(1_000_000_000)))


def _orthogonalize_all(
    call: _Call,
    flat: torch.Tensor,
    shape_of: Callable[[_Group], tuple[int, int, int]],
    is_q: Callable[[_Group], bool],
) -> None:
    """Orthogonalise every group's factor in ``flat``, laid out one group after another.

    Consecutive groups whose factors have the same shape and layout are one stack in ``flat``:
    they are orthogonalised with one batched call each (a bucket's layers mostly share a few
    widths), which saves many small per-layer operations on the critical path.
    """
    runs: list[list] = []  # [start, end, batch, rows, rank, is_q]
    offset = 0
    for g in call.groups:
        b, rows, rank = shape_of(g)
        end = offset + b * rows * rank
        q = is_q(g)
        last = runs[-1] if runs else None
        if last is not None and last[1] == offset and tuple(last[3:]) == (rows, rank, q):
            last[1], last[2] = end, last[2] + b
        else:
            runs.append([offset, end, b, rows, rank, q])
        offset = end
    for start, end, b, rows, rank, q in runs:
        stack = _factor_view(flat[start:end], (b, rows, rank), is_q=q)
        # The single-round variant has numerics of its own: it takes the faster QR.
        method = "qr" if call.state.single_round else "auto"
        lowrank.orthogonalize_(stack, call.state.orthogonalization_epsilon, method)


def _factor_view(flat: torch.Tensor, shape: tuple[int, int, int], is_q: bool) -> torch.Tensor:
    """A ``(batch, rows, rank)`` factor; ``Q`` factors are stored as ``Qᵀ`` (rank x rows).

    With ``Qᵀ`` contiguous, ``M Q``, ``Mᵀ P`` (computed as ``(Pᵀ M)ᵀ``) and ``P Qᵀ`` all read ``M``
    row by row; CPU BLAS is several times slower on an n x 2 right-hand side stored row-major.
    """
    if not is_q:
        return flat.view(shape)
    batch, rows, rank = shape
    return flat.view(batch, rank, rows).transpose(1, 2)


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _compute_sent(call: _Call, send: torch.Tensor) -> None:
    """``P = M Q`` (or ``Q = Mᵀ P`` for a single-round Q step) into views of ``send``."""
    offset = 0
    for g in call.groups:
        shape = _sent_shape(g)
        g.sent = _factor_view(
            send[offset : offset + _numel(shape)], shape, is_q=g.entries[0].step == _Q_STEP
        )
        offset += _numel(shape)
        first = g.entries[0]
        if call.state.single_round and not g.stacked:
            _direct_factor(call, first, g.known[0], g.sent[0])
        elif first.step == _Q_STEP:
            lowrank.right_factor_into(g.stack, g.known, g.sent)
        else:
            lowrank.left_factor_into(g.stack, g.known, g.sent, exact=not call.state.single_round)


def reads_back_checks(memory: torch.Tensor) -> bool:
    """Whether the single-round pass checks each gradient block by reading a sum back.

    Only on CPU, where that costs one sum a block; on a GPU it would stall the stream.
    """
    return memory.device.type == "cpu"


def _direct_factor(call: _Call, e: _Entry, known: torch.Tensor, sent: torch.Tensor) -> None:
    """Single round, a matrix on its own: memory = gradient + previous error, and its factor.

    One pass of row blocks adds the gradient into the memory and forms the factor of the sum,
    so that after the collective only ``P Qᵀ`` is left to write. Products still pending are
    subtracted in that pass when they are due, and otherwise from the thin factor. On CPU, a
    gradient block that is not finite is not added, nor any after it (checking costs one sum
    a block there). On a GPU, reading a check back would stall the stream: non-finite elements
    are added as zeros and the factor is set to NaN on the device, so the collective's result,
    the same on every rank, says that some rank's gradient was not finite.
    """
    state = call.state
    q_step = e.step == _Q_STEP
    if not state.use_error_feedback:
        if q_step:
            lowrank.right_factor_into(e.matrix.unsqueeze(0), known.unsqueeze(0), sent.unsqueeze(0))
        else:
            lowrank.left_factor_into(
                e.matrix.unsqueeze(0), known.unsqueeze(0), sent.unsqueeze(0), exact=False
            )
        return
    if e.memory is None:
        e.memory = state._errors[e.key] = torch.zeros_like(e.matrix)
        e.created = True
    check = reads_back_checks(e.memory)
    args = (e.memory, e.matrix, e.pending if e.folds else None)
    if q_step:
        e.written = lowrank.accumulate_right_factor_(*args, known, sent.t(), call.scratch(), check)
        if e.pending is not None and not e.folds:
            lowrank.deduct_pending_right_(sent.t(), e.pending, known)
    else:
        e.written = lowrank.accumulate_left_factor_(*args, known.t(), sent, call.scratch(), check)
        if e.pending is not None and not e.folds:
            lowrank.deduct_pending_left_(sent, e.pending, known.t())
    if not check:
        sent.masked_fill_(~torch.isfinite(e.matrix).all(), float("nan"))
    if e.folds:
        del state._pending[e.key]  # now in the memory (a bad step restores that, see below)


def _write_direct(call: _Call, g: _Group, p: torch.Tensor, qt: torch.Tensor) -> None:
    """Single round, after a finite result: the gradient becomes ``P Qᵀ``, which joins the
    products pending on the memory."""
    e = g.entries[0]
    if e.memory is not None:
        call.state._push_pending(e.key, p, qt)
    lowrank.product_into(e.matrix, p, qt)


def _restore_direct(call: _Call, e: _Entry) -> None:
    """Single round, after a result that is not finite: the memory goes back to the last error.

    The gradient added into the memory is taken back out, which restores the previous error
    to the rounding of one addition; its non-finite elements were added as zeros (on a GPU)
    or not at all (on CPU), and are taken out as such. A sum that overflowed restarts from
    zero instead.
    """
    state = call.state
    if e.created:
        del state._errors[e.key]
    elif e.memory is not None:
        # Rows before ``written`` hold the gradient added (and, on a step that folds, the
        # pending products subtracted); the others are untouched. Both become the previous
        # error, with the products handed to this step subtracted everywhere.
        added = e.matrix[: e.written].nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        restored = e.memory[: e.written].sub_(added)
        torch.nan_to_num_(restored, nan=0.0, posinf=0.0, neginf=0.0)
        if e.folds and e.written < e.memory.shape[0]:
            p0, q0t = e.pending
            lowrank.subtract_product_(e.memory[e.written :], p0[e.written :], q0t)


def _all_finite(*tensors: torch.Tensor) -> bool:
    # Decided on reduced data, identical on every rank, so every rank takes the same branch.
    return lowrank.is_finite(*tensors)


def _undo_compensation(call: _Call) -> None:
    if not call.state.use_error_feedback:
        return
    errors = call.state._errors
    for key, t in zip(call.uncompressed_keys, call.uncompressed):
        if key in errors:
            t.sub_(errors[key])
    for e in call.entries:
        if e.error_in_matrix:
            e.matrix.sub_(errors[e.key])


def _unpack_uncompressed(call: _Call, averaged: torch.Tensor, update: bool) -> None:
    """Copy the averages back; remember ``local - mean`` (error feedback, as PyTorch does)."""
    state, offset = call.state, 0
    remember = update and state.use_error_feedback
    for key, t in zip(call.uncompressed_keys, call.uncompressed):
        mean = averaged[offset : offset + t.numel()].view_as(t)
        offset += t.numel()
        if remember:
            error = state._errors.get(key)
            if error is None or error.shape != t.shape:
                error = state._errors[key] = torch.empty_like(t)
            torch.sub(t, mean, out=error)
        t.copy_(mean)


def _decompress(
    call: _Call,
    p_of: Callable[[_Group], torch.Tensor],
    q_of: Callable[[_Group], torch.Tensor],
    update: bool,
) -> None:
    """Write ``P Qᵀ`` into the gradients and, if ``update``, remember the new error."""
    state = call.state
    remember = update and state.use_error_feedback
    scratch = call.scratch()
    for g in call.groups:
        p, q = p_of(g), q_of(g)
        if state.single_round and not g.stacked:
            _write_direct(call, g, p[0], q[0].t())
            continue
        for i, e in enumerate(g.entries):
            error = None
            if remember:
                error = state._errors.get(e.key)
                if error is None or error.shape != e.matrix.shape:
                    error = state._errors[e.key] = torch.empty_like(e.matrix)
            # Q factors are stored as Qᵀ, so q[i].t() is the contiguous (rank, cols) matrix.
            lowrank.reconstruct_(g.stack[i], p[i], q[i].t(), error, scratch)
            if g.stacked:
                e.matrix.copy_(g.stack[i])
    if call.writeback is not None:
        call.writeback()


def _finish_step(call: _Call) -> None:
    """Per-step bookkeeping done in the hook thread, in bucket order."""
    call.state.maybe_increase_iter(call.bucket)


# -- two rounds: P then Q -----------------------------------------------------------------------
def _two_rounds(call: _Call) -> torch.futures.Future[torch.Tensor]:
    group = call.group
    issuer = comm.issuer_for(group)
    dtype, device = call.buffer.dtype, call.buffer.device
    # The uncompressed tensors need no compression work: start their allreduce first.
    packed = torch.empty(sum(t.numel() for t in call.uncompressed), dtype=dtype, device=device)
    _compensate_uncompressed(call)
    lowrank.pack_into(call.uncompressed, packed)
    plain = _sum_then_mean(packed, group) if packed.numel() else comm.completed(packed)
    _compensate_matrices(call, call.entries)
    _form_groups(call, _kinds(call))
    q_all = torch.empty(
        sum(_numel(_known_shape(g)) for g in call.groups), dtype=dtype, device=device
    )
    p_all = torch.empty(
        sum(_numel(_sent_shape(g)) for g in call.groups), dtype=dtype, device=device
    )
    _prepare_known_factors(call, q_all)
    _compute_sent(call, p_all)
    # P is orthogonalised after the sum, so it needs no division by the world size.
    p_done = comm.allreduce(p_all, group)
    both = torch.futures.collect_all([plain, p_done])
    outcome: dict[str, bool] = {}
    q_done = issuer.then(
        both,
        lambda futs: _second_round(call, futs, packed, p_all, q_all, outcome, issuer.group),
        *comm.follow_up_options(call.buffer, call.bucket.is_last()),
    )
    _finish_step(call)
    return q_done.then(lambda fut: _after_second_round(call, fut, q_all, outcome))


def _second_round(
    call: _Call,
    futs: list,
    packed: torch.Tensor,
    p_all: torch.Tensor,
    q_all: torch.Tensor,
    outcome: dict[str, bool],
    follow_up: dist.ProcessGroup,
) -> torch.futures.Future:
    for f in futs:
        # Re-raises a failed collective; on a GPU, also makes this stream wait for its result
        # (the list gathering them knows no streams).
        f.wait()
    if not _all_finite(packed, p_all):
        # Some rank's gradient was inf/NaN: send the bucket as plain allreduce would and keep
        # the error memory and factors, so a loss scaler can skip the step and go on cleanly.
        outcome["fallback"] = True
        _undo_compensation(call)
        return comm.average(call.buffer, follow_up)
    _unpack_uncompressed(call, packed, update=True)
    _orthogonalize_all(call, p_all, _sent_shape, lambda g: False)
    if call.state.warm_start:  # a direction the new Q loses is taken from the old one
        call.starts = [g.known.clone() for g in call.groups]
    for g in call.groups:
        # The new Q overwrites the starting one, in the buffer that is sent next.
        lowrank.right_factor_into(g.stack, g.sent, g.known)
    return comm.allreduce(q_all, follow_up)


def _sum_then_mean(packed: torch.Tensor, group: dist.ProcessGroup) -> torch.futures.Future:
    # PyTorch's order (sum, then divide) rather than DDP's, for the same numerics as its hook.
    world = group.size()
    return comm.allreduce(packed, group).then(lambda fut: fut.value().div_(world))


def _after_second_round(
    call: _Call, fut: torch.futures.Future, q_all: torch.Tensor, outcome: dict[str, bool]
) -> torch.Tensor:
    fut.value()
    if outcome.get("fallback"):
        return call.buffer
    q_all.div_(call.group.size())
    _decompress(call, p_of=lambda g: g.sent, q_of=lambda g: g.known, update=True)
    if call.state.warm_start:
        for g, start in zip(call.groups, call.starts):
            # A zero column of Q (a zero gradient, or one of lower rank) would stay zero at
            # every later step: M·0 = 0. Its previous direction is kept instead.
            kept = lowrank.keep_nonzero_columns(g.known, start)
            for i, e in enumerate(g.entries):
                call.state.q_memory_dict[e.key] = kept[i]
    return call.buffer


# -- one round: P or Q, packed with the uncompressed tensors ------------------------------------
def _one_round(call: _Call) -> torch.futures.Future[torch.Tensor]:
    group = call.group
    dtype, device = call.buffer.dtype, call.buffer.device
    _compensate_uncompressed(call)
    kinds = _kinds(call)
    for entries in kinds:
        if len(entries) > 1:
            _compensate_matrices(call, entries)  # stacking copies M: it must be formed first
        else:
            _attach_memory(call, entries[0])
    _form_groups(call, kinds)
    unc = sum(t.numel() for t in call.uncompressed)
    known = torch.empty(
        sum(_numel(_known_shape(g)) for g in call.groups), dtype=dtype, device=device
    )
    send = torch.empty(
        unc + sum(_numel(_sent_shape(g)) for g in call.groups), dtype=dtype, device=device
    )
    lowrank.pack_into(call.uncompressed, send[:unc])
    _prepare_known_factors(call, known)
    _compute_sent(call, send[unc:])
    issuer = comm.issuer_for(group)
    done = comm.average(send, group)
    outcome: dict[str, bool] = {}
    checked = issuer.then(
        done,
        lambda sent: _fall_back_unless_finite(call, sent, outcome, issuer.group),
        *comm.follow_up_options(call.buffer, call.bucket.is_last()),
    )
    _finish_step(call)
    return checked.then(lambda fut: _after_one_round(call, fut, send, unc, outcome))


def _fall_back_unless_finite(
    call: _Call,
    send: torch.Tensor,
    outcome: dict[str, bool],
    follow_up: dist.ProcessGroup,
) -> torch.futures.Future:
    """Single round: a result that is not finite means some rank's gradient was not.

    Every rank sees the same result, so every rank then does what the two-round variant does
    after its first round: it puts its memory and gradient back as they were and sends the
    bucket as plain allreduce would, a second collective on that step only. A loss scaler
    sees inf/NaN exactly where plain allreduce puts them and skips the step.
    """
    if _all_finite(send):
        return comm.completed(send)
    outcome["fallback"] = True
    _undo_compensation(call)
    for g in call.groups:
        if not g.stacked:
            _restore_direct(call, g.entries[0])
    return comm.average(call.buffer, follow_up)


def _after_one_round(
    call: _Call, fut: torch.futures.Future, send: torch.Tensor, unc: int, outcome: dict[str, bool]
) -> torch.Tensor:
    fut.value()
    if outcome.get("fallback"):
        return call.buffer
    state = call.state
    _unpack_uncompressed(call, send[:unc], update=True)
    _decompress(
        call,
        p_of=lambda g: g.known if g.entries[0].step == _Q_STEP else g.sent,
        q_of=lambda g: g.sent if g.entries[0].step == _Q_STEP else g.known,
        update=True,
    )
    for g in call.groups:
        q_step = g.entries[0].step == _Q_STEP
        p, q = (g.known, g.sent) if q_step else (g.sent, g.known)
        for i, e in enumerate(g.entries):
            state.p_memory_dict[e.key] = p[i].clone()
            state.q_memory_dict[e.key] = q[i].clone()
            state._last_step[e.key] = e.step
    return call.buffer


def single_round_step(state: PowerSGDState, key: Key) -> str:
    """Alternate per matrix; a matrix with no ``P`` yet starts with a ``P`` step."""
    if key in state.p_memory_dict and state._last_step.get(key) == _P_STEP:
        return _Q_STEP
    return _P_STEP


def run(call: _Call) -> torch.futures.Future[torch.Tensor]:
    return _one_round(call) if call.state.single_round else _two_rounds(call)
