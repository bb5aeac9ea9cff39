"""The arithmetic of PowerSGD: which matrices to compress, orthogonalisation, factor products.

Nothing here communicates; the hooks in :mod:`commhooks.hooks.powersgd` decide what is sent.
Every routine works on batches of matrices shaped ``(batch, rows, cols)`` so that same-shaped
matrices can be handled with one batched call, and a single matrix is just a batch of one.
"""

import math
from collections.abc import Sequence

import torch

from commhooks import _reads

__all__ = [
    "AccumulatePass",
    "accumulate_factors_",
    "accumulate_left_factor_",
    "accumulate_right_factor_",
    "approximate_into",
    "as_matrix",
    "accumulates_together",
    "compression_sizes",
    "deduct_pending_left_",
    "deduct_pending_right_",
    "finite_parts",
    "is_finite",
    "plausible_residual",
    "keep_nonzero_columns",
    "left_factor_into",
    "orthogonalize_",
    "pack_into",
    "Product",
    "product_into",
    "products_into",
    "project_",
    "reconstruct_",
    "Reconstruction",
    "reconstruct_all_",
    "scratch_elements",
    "right_factor_into",
    "should_compress",
    "square_side",
    "subtract_product_",
    "unpack_from",
    "unpack_remembering_",
]

_HALF = (torch.float16, torch.bfloat16)


def as_matrix(tensor: torch.Tensor) -> torch.Tensor:
    """View a gradient as a matrix whose rows follow its first dimension (a scalar: 1 x 1)."""
    rows = tensor.shape[0] if tensor.dim() > 0 else 1
    # Explicit column count: ``view(rows, -1)`` cannot infer it for a tensor with no elements.
    return tensor.view(rows, math.prod(tensor.shape[1:]))


def compression_sizes(rows: int, cols: int, rank: int) -> tuple[int, int]:
    """Element counts ``(uncompressed, compressed)`` of a matrix and its rank-``rank`` factors."""
    return rows * cols, (rows + cols) * rank


def should_compress(rows: int, cols: int, rank: int, min_compression_rate: float) -> bool:
    """Whether the factors are at least ``min_compression_rate`` times smaller than the matrix.

    Below that rate the saved bandwidth does not pay for the extra products and the
    approximation error, so the matrix is sent as it is.
    """
    full, compressed = compression_sizes(rows, cols, rank)
    return compressed * min_compression_rate < full


def effective_rank(rows: int, cols: int, rank: int) -> int:
    """A matrix has no more than ``min(rows, cols)`` independent directions to keep."""
    return min(rows, cols, rank)


def square_side(numel: int) -> int:
    """Side of the smallest square matrix that holds ``numel`` elements."""
    return math.isqrt(max(numel - 1, 0)) + 1 if numel > 0 else 0


def orthogonalize_(
    matrices: torch.Tensor, epsilon: float = 0.0, method: str = "auto"
) -> torch.Tensor:
    """Make the columns of each matrix in a ``(batch, rows, rank)`` stack orthonormal, in place.

    ``method="auto"`` makes PyTorch's choice, and so keeps its hook's numerics: Gram-Schmidt for
    rank <= 2 and for half precision (which ``torch.linalg.qr`` does not support; computed in
    float32), Householder QR otherwise. ``method="qr"`` always uses Householder QR (half
    precision in float32): one library call instead of a few dozen small operations, about
    ten times faster on a CPU for thin factors, where only the spanned subspace matters.
    Neither gives NaN for a column of zeros, even with ``epsilon == 0``: Gram-Schmidt leaves it
    zero, QR replaces it by a unit vector orthogonal to the others. A layer whose gradient
    vanishes then contributes zeros instead of poisoning the weights.

    Args:
        matrices: a 3-D stack, or a single 2-D matrix, with no more columns than rows.
        epsilon: added to each column norm before dividing (PyTorch's
            ``orthogonalization_epsilon``); 0 keeps the exact projection. QR does not divide
            by column norms and ignores it.
        method: ``"auto"`` or ``"qr"``.
    """
    if method not in ("auto", "qr"):
        raise ValueError(f"orthogonalize_ method must be 'auto' or 'qr', got {method!r}.")
    stack = matrices if matrices.dim() == 3 else matrices.unsqueeze(0)
    if stack.dim() != 3 or stack.shape[2] > stack.shape[1]:
        raise ValueError(
            f"orthogonalize_ expects (batch, rows, rank) with rank <= rows, got "
            f"{tuple(matrices.shape)}."
        )
    # Reductions round differently on other memory layouts; work on the row-major layout
    # PyTorch's hook uses (factors are small, so the copy is cheap) to keep its numerics.
    # Half precision is orthogonalised in float32: with 8 or 11 significant bits, Gram-Schmidt
    # cannot tell an ill-conditioned column from a dependent one.
    half = stack.dtype in _HALF
    work = stack.float() if half else stack.contiguous()
    if method == "auto" and (stack.shape[2] <= 2 or half):
        _gram_schmidt_(work, epsilon)
    else:
        _householder_(work)
    if work.data_ptr() != stack.data_ptr():
        stack.copy_(work)
    return matrices


def _gram_schmidt_(stack: torch.Tensor, epsilon: float) -> None:
    cols = stack.shape[2]
    # A column that loses nearly all of its norm (all but sqrt(eps) of it) to the projections on
    # earlier columns keeps mostly rounding error, no longer orthogonal to them; normalised as
    # it is, P Pᵀ stops being a projection and the gradient comes back badly wrong (PyTorch's
    # hook returns a rank-1 gradient compressed at rank 2 with half its size wrong). Such a
    # column is projected out a second time ("twice is enough"); if it is still within eps of
    # its original norm it lies in the earlier columns' span and becomes zero. Other columns
    # take exactly the steps of PyTorch's Gram-Schmidt, so ordinary inputs keep its numerics.
    eps = torch.finfo(stack.dtype).eps
    collapse = math.sqrt(eps)
    original = _column_norms(stack) if cols > 1 else None
    for i in range(cols):
        col = stack[:, :, i : i + 1]
        if i > 0:
            assert original is not None  # computed whenever there is a second column
            earlier = stack[:, :, :i]
            again = col - earlier @ (earlier.transpose(1, 2) @ col)
            before = original[:, :, i : i + 1]
            collapsed = _column_norms(col) <= collapse * before
            col.copy_(torch.where(collapsed, again, col))
            col.masked_fill_(collapsed & (_column_norms(col) <= eps * before), 0.0)
        col /= _safe_norm(col, epsilon)
        if i + 1 < cols:
            rest = stack[:, :, i + 1 :]
            rest -= torch.sum(col * rest, dim=1, keepdim=True) * col


def _column_norms(stack: torch.Tensor) -> torch.Tensor:
    """Column norms that neither underflow nor overflow, in float32 or wider.

    They decide, not divide: a float32 or half-precision stack's are taken in float64, which
    holds every square (two operations, where scaling each column by its peak took eight).
    """
    if stack.dtype == torch.float32 or stack.dtype in _HALF:
        wide: torch.Tensor = torch.linalg.vector_norm(
            stack, dim=1, keepdim=True, dtype=torch.float64
        )
        return wide.to(torch.float32)
    scale = stack.abs().amax(dim=1, keepdim=True)
    scale = scale.masked_fill(scale == 0, 1.0)
    norms: torch.Tensor = torch.linalg.vector_norm(stack / scale, dim=1, keepdim=True)
    return norms * scale


def _safe_norm(col: torch.Tensor, epsilon: float) -> torch.Tensor:
    # Half precision is measured in float32: its squares overflow long before the norm does.
    wide = torch.float32 if col.dtype in _HALF else None
    norm = torch.linalg.vector_norm(col, dim=1, keepdim=True, dtype=wide)
    # Squares of very small or very large values underflow to 0 or overflow to inf; only there
    # is another norm used, so ordinary columns are divided exactly as PyTorch divides them.
    # That norm is NaN only for a column holding inf or NaN, which stays non-finite; a zero
    # column is divided by the smallest normal value (or epsilon), and stays zero. Seven
    # operations a column in float32, where each is a kernel launch on a GPU.
    if norm.dtype == torch.float32:
        # float64 holds the square of every float32 value, and float32 its norm when finite.
        safe = torch.linalg.vector_norm(col, dim=1, keepdim=True, dtype=torch.float64)
        safe = safe.to(torch.float32)
    else:  # nothing wider: the norm of the column scaled by its peak
        peak = torch.linalg.vector_norm(col, math.inf, dim=1, keepdim=True)
        safe = torch.linalg.vector_norm(col / peak, dim=1, keepdim=True).mul_(peak)
        safe = safe.nan_to_num_(nan=0.0, posinf=math.inf)  # a zero column's 0/0
    norm = torch.where(norm.nan_to_num(posinf=0.0) > 0, norm, safe)
    if epsilon > 0:
        return norm.add_(epsilon)
    # Not a subnormal divisor: where denormals are flushed to zero (torch.set_flush_denormal)
    # it would be 0, and a zero column NaN. A column of subnormal values only comes out shorter.
    return norm.clamp_min_(torch.finfo(norm.dtype).smallest_normal)


def _householder_(stack: torch.Tensor) -> None:
    # Householder QR never divides by a column norm: a zero column gets a unit vector
    # orthogonal to the others, which only widens the subspace the gradient is projected on.
    q, _ = torch.linalg.qr(stack)
    stack.copy_(q)


def keep_nonzero_columns(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new`` with each column that is all zeros replaced by the same column of ``old``.

    A warm-started power iteration cannot leave a zero column: ``M·0 = 0`` at every later step,
    so a layer whose gradient vanished once (or fell below the rank) would lose that direction
    for good. Orthogonalisation before the next use makes the mix orthonormal again. Works on
    ``(..., rows, rank)`` stacks without reading values back to the host.
    """
    return torch.where((new == 0).all(dim=-2, keepdim=True), old, new)


def left_factor_into(
    matrices: torch.Tensor, q: torch.Tensor, out: torch.Tensor, exact: bool = True
) -> None:
    """``P = M Q`` for a ``(batch, n, m)`` stack and ``(batch, m, r)`` factors.

    ``exact`` uses a row-major ``Q``, the layout PyTorch's hook uses, whose BLAS kernel rounds
    differently from the one for a ``Q`` stored as ``Qᵀ``. The latter is several times faster on
    CPU for rank >= 2, but warm-started power iteration amplifies last-bit differences, so it is
    used only where matching PyTorch bit for bit is not the point.
    """
    torch.bmm(matrices, q.contiguous() if exact else q, out=out)


def right_factor_into(matrices: torch.Tensor, p: torch.Tensor, out: torch.Tensor) -> None:
    """``Q = Mᵀ P`` for a ``(batch, n, m)`` stack and ``(batch, n, r)`` factors.

    When ``out`` is stored as ``Qᵀ`` (its transpose contiguous), computed as ``Qᵀ = Pᵀ M``,
    which reads ``M`` row by row: the same values, several times faster on CPU.
    """
    if out.transpose(1, 2).is_contiguous():
        torch.bmm(p.transpose(1, 2), matrices, out=out.transpose(1, 2))
    else:
        torch.bmm(matrices.transpose(1, 2), p, out=out)


Product = tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]
"""``(matrices, factor, out, right)``: ``out = M factor``, or with ``right`` ``out = Mᵀ factor``
(see :func:`left_factor_into` and :func:`right_factor_into`)."""


def project_(
    starts: Sequence[torch.Tensor],
    products: Sequence[Product],
    epsilon: float = 0.0,
    method: str = "auto",
    exact: bool = True,
) -> None:
    """One half of a power iteration: orthogonalise each stack of ``starts``, then form each
    product of ``products`` from them.

    A bucket's compression is this sequence over many small matrices; one call here keeps the
    whole of it, in order, in the module that owns the arithmetic.
    """
    for stack in starts:
        orthogonalize_(stack, epsilon, method)
    for matrices, factor, out, right in products:
        if right:
            right_factor_into(matrices, factor, out)
        else:
            left_factor_into(matrices, factor, out, exact=exact)


def approximate_into(p: torch.Tensor, q: torch.Tensor, out: torch.Tensor) -> None:
    """``M ≈ P Qᵀ``, written into ``out`` (a ``(batch, n, m)`` stack)."""
    torch.bmm(p, q.transpose(1, 2), out=out)


# Up to this rank, P Qᵀ is written as a sum of outer products.
_OUTER_RANK = 4

# Row blocks of about this many bytes stay in cache between the passes fused over them; larger
# blocks also mean fewer operations, whose fixed cost is felt on CPU.
_BLOCK_BYTES = 2 << 20


def _block_rows(matrix: torch.Tensor) -> int:
    return max(1, _BLOCK_BYTES // max(1, matrix.shape[1] * matrix.element_size()))


def _row_blocks(matrix: torch.Tensor) -> list[slice]:
    """The rows of ``matrix`` in blocks of :func:`_block_rows`, the last one possibly shorter."""
    n, step = matrix.shape[0], _block_rows(matrix)
    return [slice(start, min(start + step, n)) for start in range(0, n, step)]


def _blocked(matrix: torch.Tensor) -> bool:
    """Whether the fused passes here go block of rows by block of rows.

    On a CPU a block stays in cache between the operations fused over it. A GPU streams whole
    matrices at its full memory bandwidth, and there each block would only add kernel
    launches (a 4096 x 4096 float32 matrix is 32 blocks): it takes each matrix in one piece,
    and so does a CPU matrix that takes a GPU's branch (:func:`commhooks._reads.as_on_a_gpu`:
    tests, and the host cost a GPU pays measured on a CPU).
    """
    return _reads.are_free(matrix)


def accumulate_left_factor_(
    memory: torch.Tensor,
    matrix: torch.Tensor,
    pending: tuple[torch.Tensor, torch.Tensor] | None,
    qt: torch.Tensor,
    out: torch.Tensor,
    scratch: torch.Tensor,
    check: bool = True,
    finite: bool = False,
) -> int:
    """``memory += matrix - P₀ Q₀ᵀ`` and ``out = memory Q``, in one pass of row blocks.

    With ``check``, a block of ``matrix`` that is not finite is not added, nor any block
    after it (their sums are formed in ``scratch`` for ``out`` only): a non-finite gradient
    never enters the memory. ``out`` is complete either way, and then not finite. Without
    ``check`` (on a GPU, where reading a block's sum back would stall the stream), non-finite
    elements are added as zeros and ``out`` may be finite: the caller marks it. ``finite``
    says the caller found ``matrix`` finite already (one check for many matrices): nothing is
    checked. Returns the rows of the memory updated.
    """
    if not _blocked(memory):
        formed, written = _accumulated_whole(memory, matrix, pending, check, finite)
        torch.mm(formed, qt.t(), out=out)
        return written
    rank = qt.shape[0]
    written = memory.shape[0]
    thin = scratch[2 * _block_elements(memory) :]  # after the rooms _accumulated_block uses
    for rows in _row_blocks(memory):
        formed, written = _accumulated_block(
            memory, matrix, pending, rows, scratch, written, check, finite
        )
        count = formed.shape[0]
        block_t = thin[: rank * count].view(rank, count)
        torch.mm(qt, formed.t(), out=block_t)
        out[rows].copy_(block_t.t())
    return written


def accumulate_right_factor_(
    memory: torch.Tensor,
    matrix: torch.Tensor,
    pending: tuple[torch.Tensor, torch.Tensor] | None,
    p: torch.Tensor,
    out_t: torch.Tensor,
    scratch: torch.Tensor,
    check: bool = True,
    finite: bool = False,
) -> int:
    """``memory += matrix - P₀ Q₀ᵀ`` and ``out_t = Pᵀ memory``, in one pass of row blocks.

    As :func:`accumulate_left_factor_`. Returns the rows of the memory updated.
    """
    if not _blocked(memory):
        formed, written = _accumulated_whole(memory, matrix, pending, check, finite)
        torch.mm(p.t(), formed, out=out_t)
        return written
    written = memory.shape[0]
    for rows in _row_blocks(memory):
        formed, written = _accumulated_block(
            memory, matrix, pending, rows, scratch, written, check, finite
        )
        if rows.start == 0:
            torch.mm(p[rows].t(), formed, out=out_t)
        else:
            out_t.addmm_(p[rows].t(), formed)
    return written


AccumulatePass = tuple[
    torch.Tensor,
    torch.Tensor,
    tuple[torch.Tensor, torch.Tensor] | None,
    bool,
    torch.Tensor,
    torch.Tensor,
    bool,
]
"""``(memory, matrix, pending, folds, known, sent, right)``: one matrix of
:func:`accumulate_factors_`. ``pending`` is ``(P₀, Q₀ᵀ)`` or ``None``; ``folds`` subtracts it from
the memory, else it is deducted from ``sent`` only. ``right`` forms ``sent = Q = memoryᵀ P``
from ``known = P`` (``sent`` stored as ``Qᵀ``), else ``sent = P = memory Q`` from ``known = Q``."""


def fits_one_block(matrix: torch.Tensor) -> bool:
    """Whether ``matrix`` is 2-D and no larger than one block of rows of the fused passes.

    Such a matrix stays in a CPU's cache, and on a GPU one more pass over it costs less than
    a kernel launch: deferring work on it to save a pass over its memory does not pay.
    """
    return matrix.dim() == 2 and _block_rows(matrix) >= matrix.shape[0]


def accumulates_together(matrices: Sequence[torch.Tensor]) -> bool:
    """Whether :func:`accumulate_factors_` can take ``matrices``: 2-D matrices on a CPU whose
    checks are read back, each small enough to be one block of rows of the fused passes.

    A bucket's matrices share a few shapes: each shape is checked once.
    """
    if not matrices or not _reads.are_free(matrices[0]):
        return False
    kinds = {(m.shape, m.device.type, m.element_size()) for m in matrices}
    return all(
        len(shape) == 2 and device == "cpu" and _BLOCK_BYTES // max(1, shape[1] * size) >= shape[0]
        for shape, device, size in kinds
    )


def accumulate_factors_(passes: Sequence[AccumulatePass]) -> None:
    """:func:`accumulate_left_factor_` or :func:`accumulate_right_factor_` of each pass, and
    its pending product deducted from ``sent`` (:func:`deduct_pending_left_`,
    :func:`deduct_pending_right_`), for finite matrices that :func:`accumulates_together`.

    A bucket's small matrices would otherwise pay a dozen operations' fixed cost each, most of
    the work: every memory takes its matrix in one batched addition and every ``P`` is copied
    into place in one batched copy. Each product is still one ``mm`` per matrix, as in the
    per-matrix passes, whose bits a batched kernel does not keep for thin factors; elementwise
    sums and copies are exact, so the results are the per-matrix passes' bits.
    """
    if not passes:
        return
    torch._foreach_add_([each[0] for each in passes], [each[1] for each in passes])
    outs: list[torch.Tensor] = []
    formed: list[torch.Tensor] = []
    # (out, P₀, Q₀ᵀ, known, its transpose, right): the pending products' deductions.
    deductions = []
    for memory, _, pending, folds, known, sent, right in passes:
        if folds and pending is not None:
            memory.sub_(torch.mm(pending[0], pending[1]))
        known_t = known.t()
        if right:
            out = sent.t()
            torch.mm(known_t, memory, out=out)
        else:
            out = sent
            outs.append(sent)
            formed.append(torch.mm(known_t, memory.t()).t())
        if pending is not None and not folds:
            deductions.append((out, *pending, known, known_t, right))
    if outs:
        torch._foreach_copy_(outs, formed)
    for out, p0, q0t, known, known_t, right in deductions:
        if right:  # deduct_pending_right_(out, (P₀, Q₀ᵀ), P)
            out.addmm_(torch.mm(known_t, p0), q0t, alpha=-1)
        else:  # deduct_pending_left_(out, (P₀, Q₀ᵀ), Qᵀ)
            out.addmm_(p0, torch.mm(q0t, known), alpha=-1)


def accumulate_whole_factors_(
    passes: Sequence[AccumulatePass], cleaned: Sequence[torch.Tensor] | None = None
) -> None:
    """:func:`accumulate_left_factor_` or :func:`accumulate_right_factor_` of each pass, on a
    GPU's branch (whole matrices, unchecked: a non-finite element is added as zero, for the
    caller to mark), and its pending product deducted from ``sent``.

    The same operations on each matrix as those passes, in one call: every memory takes its
    cleaned matrix in one batched addition (one kernel on a GPU for many small matrices, the
    same elementwise sums), then each matrix's products follow as they do there, so the results
    are those passes' bits with fewer launches and less of the host's time per matrix.
    ``cleaned``: each pass's matrix with its non-finite elements zeroed, where the caller made
    them together (:func:`finite_parts`); else each is cleaned here, one pass a matrix.
    """
    if not passes:
        return
    if cleaned is None:
        cleaned = [_zeroed(each[1]) for each in passes]
    torch._foreach_add_([each[0] for each in passes], list(cleaned))
    for memory, _, pending, folds, known, sent, right in passes:
        if folds and pending is not None:
            memory.addmm_(pending[0], pending[1], alpha=-1)
        if right:  # sent = Q (stored as Qᵀ) = memoryᵀ P, from known = P
            torch.mm(known.t(), memory, out=sent.t())
            if pending is not None and not folds:
                deduct_pending_right_(sent.t(), pending, known)
        else:  # sent = P = memory Q, from known = Q
            torch.mm(memory, known, out=sent)
            if pending is not None and not folds:
                deduct_pending_left_(sent, pending, known.t())


def finite_parts(stacks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The matrices of each ``(count, n, m)`` stack, in order, each a copy with its non-finite
    elements zeroed (what :func:`accumulate_whole_factors_` adds): one pass a stack, where
    cleaning them one by one takes a pass (a kernel launch on a GPU) a matrix."""
    return [matrix for stack in stacks for matrix in _zeroed(stack).unbind(0)]


def _zeroed(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` with inf and NaN replaced by zeros."""
    return tensor.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def deduct_pending_left_(
    out: torch.Tensor, pending: tuple[torch.Tensor, torch.Tensor], qt: torch.Tensor
) -> None:
    """``out -= P₀ (Q₀ᵀ Q)``: turns ``M Q`` into ``(M - P₀ Q₀ᵀ) Q`` on the thin result.

    This is how a factor of a memory is formed while ``P₀ Q₀ᵀ`` is still to be subtracted from
    it, without a pass over the memory.
    """
    p0, q0t = pending
    out.addmm_(p0, torch.mm(q0t, qt.t()), alpha=-1)


def deduct_pending_right_(
    out_t: torch.Tensor, pending: tuple[torch.Tensor, torch.Tensor], p: torch.Tensor
) -> None:
    """``out_t -= (Pᵀ P₀) Q₀ᵀ``: turns ``Pᵀ M`` into ``Pᵀ (M - P₀ Q₀ᵀ)`` on the thin result."""
    p0, q0t = pending
    out_t.addmm_(torch.mm(p.t(), p0), q0t, alpha=-1)


def _accumulated_whole(
    memory: torch.Tensor,
    matrix: torch.Tensor,
    pending: tuple[torch.Tensor, torch.Tensor] | None,
    check: bool,
    finite: bool = False,
) -> tuple[torch.Tensor, int]:
    """:func:`_accumulated_block` over the whole matrix at once (a GPU's way)."""
    written = memory.shape[0]
    if finite:
        formed = memory.add_(matrix)
    elif not check:
        # As for a block: a non-finite element is added as zero, and nothing is read back.
        formed = memory.add_(matrix.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0))
    elif is_finite(matrix):
        formed = memory.add_(matrix)
    else:
        formed, written = memory + matrix, 0
    if pending is not None:
        # One fused kernel, without a matrix of scratch to write the product into.
        formed.addmm_(pending[0], pending[1], alpha=-1)
    return formed, written


def _accumulated_block(
    memory: torch.Tensor,
    matrix: torch.Tensor,
    pending: tuple[torch.Tensor, torch.Tensor] | None,
    rows: slice,
    scratch: torch.Tensor,
    written: int,
    check: bool,
    finite: bool = False,
) -> tuple[torch.Tensor, int]:
    """One block of ``memory + matrix - P₀ Q₀ᵀ``: in the memory, or in ``scratch`` once a
    block of ``matrix`` was found not finite. Returns it and the rows updated so far.

    ``scratch`` has room for two blocks: the first for such a sum, the second for ``P₀ Q₀ᵀ``
    (a product written out and subtracted is faster on CPU than an in-place ``addmm_``).
    """
    block, addend = memory[rows], matrix[rows]
    room = _block_elements(memory)
    if written == memory.shape[0] and (finite or not check or is_finite(addend)):
        if not check and not finite:
            # Unchecked (nothing is read back), a non-finite element is added as zero: the
            # memory keeps its value there, and the caller marks the factor as not finite.
            addend = torch.nan_to_num(
                addend, nan=0.0, posinf=0.0, neginf=0.0, out=scratch[: block.numel()].view_as(block)
            )
        formed = block.add_(addend)
    else:
        written = min(written, rows.start)
        formed = torch.add(block, addend, out=scratch[: block.numel()].view_as(block))
    if pending is not None:
        product = scratch[room : room + block.numel()].view_as(block)
        formed.sub_(torch.mm(pending[0][rows], pending[1], out=product))
    return formed, written


def is_finite(*tensors: torch.Tensor) -> bool:
    """Whether every element of ``tensors`` is finite (an empty tensor is).

    A sum is one fast pass with a scalar result, and the sums of all tensors are read back
    together (one wait for the device, where there is one); only if the total is not finite
    (an inf or NaN, or finite values whose sum overflows) are the elements themselves checked.
    Half precision is summed in float32, where a sum of float16 values cannot overflow.
    """
    sums = [t.sum(dtype=torch.float32) if t.dtype in _HALF else t.sum() for t in tensors]
    if not sums:
        return True
    total = sum(sums[1:], sums[0])
    return math.isfinite(total.item()) or all(bool(torch.isfinite(t).all()) for t in tensors)


def subtract_product_(memory: torch.Tensor, p: torch.Tensor, qt: torch.Tensor) -> None:
    """``memory -= P Qᵀ`` in place, by blocks of rows."""
    if not _blocked(memory):
        memory.addmm_(p, qt, alpha=-1)
        return
    room = memory.new_empty(_block_elements(memory))
    for rows in _row_blocks(memory):
        block = memory[rows]
        block.sub_(torch.mm(p[rows], qt, out=room[: block.numel()].view_as(block)))


def product_into(out: torch.Tensor, p: torch.Tensor, qt: torch.Tensor) -> None:
    """``out = P Qᵀ`` for 2-D ``out`` (n, m), written block of rows by block of rows."""
    if not _blocked(out):
        torch.mm(p, qt, out=out)
        return
    rank = p.shape[1]
    for rows in _row_blocks(out):
        block, p_block = out[rows], p[rows]
        if rank > _OUTER_RANK:
            torch.mm(p_block, qt, out=block)
            continue
        # A sum of outer products: for a thin P, BLAS' rank-k kernels are slower than this,
        # and a broadcast product and ``addcmul_`` are faster than ``outer`` and ``addr_``.
        torch.mul(p_block[:, :1], qt[:1], out=block)
        for k in range(1, rank):
            block.addcmul_(p_block[:, k : k + 1], qt[k : k + 1])


def reconstruct_(
    matrix: torch.Tensor,
    p: torch.Tensor,
    qt: torch.Tensor,
    error: torch.Tensor | None,
    scratch: torch.Tensor,
) -> None:
    """``error = matrix - P Qᵀ`` (if ``error`` is given), then ``matrix = P Qᵀ``, in one pass.

    ``P Qᵀ`` is formed one block of rows at a time in ``scratch`` (at least one block's
    elements), so the matrix is read once and written once, and the error written once,
    instead of one pass for the residual and another for the approximation.
    """
    if not _blocked(matrix):
        if error is not None:
            # Without a scratch matrix: the approximation is formed in ``error`` and turned
            # into the residual there, then formed again in ``matrix`` (the same kernel on the
            # same inputs, so the same bits): two thin products cost less than a matrix of
            # memory on a GPU.
            torch.mm(p, qt, out=error)
            torch.sub(matrix, error, out=error)
        torch.mm(p, qt, out=matrix)
        return
    rows = _block_rows(matrix)
    for start in range(0, matrix.shape[0], rows):
        block = matrix[start : start + rows]
        approx = scratch[: block.numel()].view_as(block)
        torch.mm(p[start : start + rows], qt, out=approx)
        if error is not None:
            torch.sub(block, approx, out=error[start : start + rows])
        block.copy_(approx)


Reconstruction = tuple[Sequence[torch.Tensor], torch.Tensor, torch.Tensor]
"""``(matrices, P, Qᵀ)``: 2-D matrices of one shape and the stacks of their factors,
``(batch, n, r)`` and ``(batch, r, m)``."""


def reconstruct_all_(
    groups: Sequence[Reconstruction],
    errors: Sequence[torch.Tensor] | None,
    scratch: torch.Tensor,
) -> None:
    """:func:`reconstruct_` of each matrix of each group from its ``P`` and ``Qᵀ``; ``errors``
    (if given) has one tensor per matrix, in the groups' order.

    Matrices that fit one block of rows are approximated with batched products (on a CPU
    their kernel computes each matrix's product exactly as one product per matrix does) and
    their errors and results written with one batched operation each: per matrix, a step would
    otherwise pay three operations' fixed cost (three launches on a GPU), which on small
    matrices is most of the work.
    """
    at = 0
    for matrices, p, qt in groups:
        mine = None if errors is None else list(errors[at : at + len(matrices)])
        at += len(matrices)
        if not matrices:
            continue
        first = matrices[0]
        if len(matrices) == 1 or _block_rows(first) < first.shape[0]:
            for i, matrix in enumerate(matrices):
                reconstruct_(matrix, p[i], qt[i], None if mine is None else mine[i], scratch)
            continue
        _reconstruct_small_(list(matrices), p, qt, mine)


def _reconstruct_small_(
    matrices: list[torch.Tensor],
    p: torch.Tensor,
    qt: torch.Tensor,
    errors: list[torch.Tensor] | None,
) -> None:
    # Chunks of a few blocks' bytes bound the batched product's memory.
    first = matrices[0]
    chunk = max(1, 4 * _BLOCK_BYTES // max(1, first.numel() * first.element_size()))
    for start in range(0, len(matrices), chunk):
        end = min(start + chunk, len(matrices))
        approx = list(torch.bmm(p[start:end], qt[start:end]).unbind(0))
        if errors is not None:
            torch._foreach_copy_(errors[start:end], matrices[start:end])
            torch._foreach_sub_(errors[start:end], approx)
        torch._foreach_copy_(matrices[start:end], approx)


def products_into(groups: Sequence[Reconstruction]) -> None:
    """:func:`product_into` of each matrix of each group: ``matrix = P Qᵀ``.

    Matrices that fit one block of rows on a CPU are written from one batched pass over the
    group's stacks, which computes each element as :func:`product_into` does (the same sum of
    outer products for a thin ``P``, or the same product), then copied with one operation. On
    a GPU's branch such matrices take batched products, a few blocks' bytes at a time, and
    the same copy: a few launches for the group instead of one a matrix.
    """
    for matrices, p, qt in groups:
        if not matrices:
            continue
        first = matrices[0]
        if len(matrices) == 1 or _block_rows(first) < first.shape[0]:
            for i, matrix in enumerate(matrices):
                product_into(matrix, p[i], qt[i])
            continue
        if not _blocked(first):
            _reconstruct_small_(list(matrices), p, qt, None)
            continue
        rank = p.shape[2]
        if rank > _OUTER_RANK:
            approx = torch.bmm(p, qt)
        else:
            approx = torch.mul(p[:, :, :1], qt[:, :1])
            for k in range(1, rank):
                approx.addcmul_(p[:, :, k : k + 1], qt[:, k : k + 1])
        torch._foreach_copy_(list(matrices), list(approx.unbind(0)))


def unpack_remembering_(
    flat: torch.Tensor, tensors: Sequence[torch.Tensor], errors: Sequence[torch.Tensor] | None
) -> None:
    """:func:`unpack_from`, and first ``errors[i] = tensors[i] - `` its new value, if given.

    The error feedback of the tensors sent as they are (their value minus the average), with
    one batched operation per pass instead of one per tensor.
    """
    if not tensors:
        return
    means = _slices(flat, tensors)
    if errors is not None:
        torch._foreach_copy_(list(errors), list(tensors))
        torch._foreach_sub_(list(errors), means)
    torch._foreach_copy_(list(tensors), means)


def scratch_elements(matrix: torch.Tensor, rank: int = 0) -> int:
    """Elements of the ``scratch`` that the blocked routines here need for a 2-D ``matrix``.

    Two blocks of rows, and room for a rank-``rank`` factor of a block or of the matrix; none
    where the matrix is taken in one piece (on a GPU).
    """
    if not _blocked(matrix):
        return 0
    rows = min(matrix.shape[0], _block_rows(matrix))
    return 2 * rows * matrix.shape[1] + rank * max(rows, matrix.shape[1])


def _block_elements(matrix: torch.Tensor) -> int:
    return min(matrix.shape[0], _block_rows(matrix)) * matrix.shape[1]


def pack_into(tensors: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy ``tensors`` one after another into the flat ``out``; returns ``out``.

    One batched copy: a bucket's many small tensors (biases, norms) would otherwise cost one
    operation each.
    """
    if tensors:
        torch._foreach_copy_(_slices(out, tensors), list(tensors))
    return out


def unpack_from(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Inverse of :func:`pack_into`: copy consecutive slices of ``flat`` back into ``tensors``."""
    if tensors:
        torch._foreach_copy_(list(tensors), _slices(flat, tensors))


def _slices(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Consecutive slices of ``flat``, each viewed as the tensor of ``tensors`` it stands for."""
    sizes = [t.numel() for t in tensors]
    parts = flat[: sum(sizes)].split_with_sizes(sizes)
    return [part if t.dim() == 1 else part.view(t.shape) for part, t in zip(parts, tensors)]


RESIDUAL_SLACK = 1000.0
"""How many times the gradient's norm a loaded residual may reach (see
:func:`plausible_residual`)."""


def plausible_residual(residual: torch.Tensor, gradient: torch.Tensor) -> bool:
    """Whether ``residual`` can be what a low-rank approximation left out of ``gradient``.

    The residual of approximating ``M = gradient + previous residual`` is ``M - P Qᵀ``, an
    orthogonal projection's remainder, so no larger than ``M``: with error feedback it stays
    within a small multiple of the gradient's norm (as much as the approximation keeps missing
    of it). A loaded memory past :data:`RESIDUAL_SLACK` times the gradient's norm cannot have
    come from training this model at this point. Synchronises with the device.
    """
    if residual.numel() == 0 or gradient.numel() == 0:
        return True
    size = float(torch.linalg.vector_norm(residual.detach().float()))
    return size <= RESIDUAL_SLACK * float(torch.linalg.vector_norm(gradient.float()))
