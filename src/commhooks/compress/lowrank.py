"""The arithmetic of PowerSGD: which matrices to compress, orthogonalisation, factor products.

Nothing here communicates; the hooks in :mod:`commhooks.hooks.powersgd` decide what is sent.
Orthogonalisation works on stacks of factors shaped ``(batch, rows, rank)``, so that
same-shaped factors are handled with one batched call, and a single factor is a batch of one.
"""

import math
from collections.abc import Sequence

import torch

__all__ = [
    "RESIDUAL_SLACK",
    "as_matrix",
    "compression_sizes",
    "effective_rank",
    "keep_nonzero_columns",
    "orthogonalize_",
    "pack_into",
    "plausible_residual",
    "should_compress",
    "square_side",
    "unpack_from",
    "views_like",
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
    """Whether the factors are ``min_compression_rate`` times smaller than the matrix: below,
    the bandwidth saved does not pay for the products and the error."""
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

    ``method="auto"`` makes PyTorch's choice, and keeps its hook's numerics: Gram-Schmidt for
    rank <= 2 and half precision, Householder QR otherwise. ``method="qr"`` always uses QR: one
    library call, about ten times faster on a CPU for thin factors. Neither gives NaN for a
    column of zeros (Gram-Schmidt leaves it zero, QR makes it a unit vector orthogonal to the
    others), so a vanishing gradient contributes zeros instead of poisoning the weights.

    Args:
        matrices: a 3-D stack, or a single 2-D matrix, with no more columns than rows.
        epsilon: added to each column norm before dividing (PyTorch's
            ``orthogonalization_epsilon``; QR ignores it); 0 keeps the exact projection.
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
    if cols == 1:  # rank 1, the default: the column's norm alone (no view, no projection)
        stack.div_(_safe_norm(stack, epsilon))
        return
    # A column that loses nearly all of its norm (all but sqrt(eps) of it) to the projections on
    # earlier columns keeps mostly rounding error, no longer orthogonal to them; normalised as
    # it is, P Pᵀ stops being a projection and the gradient comes back badly wrong (PyTorch's
    # hook returns a rank-1 gradient compressed at rank 2 with half its size wrong). Such a
    # column is projected out a second time ("twice is enough"); if it is still within eps of
    # its original norm it lies in the earlier columns' span and becomes zero. Other columns
    # take exactly the steps of PyTorch's Gram-Schmidt, so ordinary inputs keep its numerics.
    eps = torch.finfo(stack.dtype).eps
    collapse = math.sqrt(eps)
    original = _column_norms(stack)
    for i in range(cols):
        col = stack[:, :, i : i + 1]
        if i > 0:
            earlier = stack[:, :, :i]
            again = col - earlier @ (earlier.transpose(1, 2) @ col)
            before = original[:, :, i : i + 1]
            collapsed = _column_norms(col) <= collapse * before
            col.copy_(torch.where(collapsed, again, col))
            col.masked_fill_(collapsed & (_column_norms(col) <= eps * before), 0.0)
        col.div_(_safe_norm(col, epsilon))
        if i + 1 < cols:
            rest = stack[:, :, i + 1 :]
            rest -= torch.sum(col * rest, dim=1, keepdim=True) * col


def _column_norms(stack: torch.Tensor) -> torch.Tensor:
    """Column norms that neither underflow nor overflow (float32's and half's in float64)."""
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
    # Squares of very small or very large values underflow to 0 or overflow to inf; only there
    # is another norm used, so ordinary columns are divided exactly as PyTorch divides them.
    # That norm is NaN only for a column holding inf or NaN, which stays non-finite; a zero
    # column is divided by the smallest normal value (or epsilon), and stays zero. Six
    # operations a column in float32, where each is a kernel launch on a GPU.
    norm = torch.linalg.vector_norm(col, dim=1, keepdim=True)
    if norm.dtype == torch.float32:
        # float64 holds the square of every float32 value, and float32 its norm when finite.
        # The choice stays in float64: float32's norm is exact there, and a float32 column
        # divided by it in float64, then rounded, gets float32's quotient bit for bit.
        safe = torch.linalg.vector_norm(col, dim=1, keepdim=True, dtype=torch.float64)
    else:  # nothing wider: the norm of the column scaled by its peak
        peak = torch.linalg.vector_norm(col, math.inf, dim=1, keepdim=True)
        safe = torch.linalg.vector_norm(col / peak, dim=1, keepdim=True).mul_(peak)
        safe = safe.nan_to_num_(nan=0.0, posinf=math.inf)  # a zero column's 0/0
    norm = torch.where(norm.nan_to_num(posinf=0.0) > 0, norm, safe)
    if epsilon > 0:  # PyTorch's sum, in the column's precision
        return norm.to(col.dtype).add_(epsilon)
    # Not a subnormal divisor: where denormals are flushed to zero (torch.set_flush_denormal)
    # it would be 0, and a zero column NaN. A column of subnormal values only comes out shorter.
    return norm.clamp_min_(torch.finfo(col.dtype).smallest_normal)


def _householder_(stack: torch.Tensor) -> None:
    # Householder QR never divides by a column norm: a zero column gets a unit vector
    # orthogonal to the others, which only widens the subspace the gradient is projected on.
    q, _ = torch.linalg.qr(stack)
    stack.copy_(q)


def keep_nonzero_columns(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new`` with each all-zero column replaced by ``old``'s: a warm-started power iteration
    cannot keep a zero column (``M·0 = 0`` for good). No value is read back to the host."""
    return torch.where((new == 0).all(dim=-2, keepdim=True), old, new)


def pack_into(tensors: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy ``tensors`` one after another into the flat ``out`` in one batched copy (not one
    a small tensor); returns ``out``."""
    if tensors:
        torch._foreach_copy_(views_like(out, tensors), list(tensors))
    return out


def unpack_from(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Inverse of :func:`pack_into`: copy consecutive slices of ``flat`` back into ``tensors``."""
    if tensors:
        torch._foreach_copy_(list(tensors), views_like(flat, tensors))


def views_like(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Consecutive slices of ``flat``, each viewed as the tensor of ``tensors`` it stands for."""
    sizes = [t.numel() for t in tensors]
    parts = flat[: sum(sizes)].split_with_sizes(sizes)
    return [part if t.dim() == 1 else part.view(t.shape) for part, t in zip(parts, tensors)]


RESIDUAL_SLACK = 1000.0
"""How many times the gradient's norm a loaded residual may reach (see
:func:`plausible_residual`)."""


def plausible_residual(residual: torch.Tensor, gradient: torch.Tensor) -> bool:
    """Whether ``residual`` can be what a low-rank approximation left out of ``gradient``.

    ``M - P Qᵀ``, a projection's remainder, is no larger than ``M = gradient + previous
    residual``: with error feedback, a small multiple of the gradient's norm. One past
    :data:`RESIDUAL_SLACK` times it cannot come from training this model. Waits for the device.
    """
    if residual.numel() == 0 or gradient.numel() == 0:
        return True
    size = float(torch.linalg.vector_norm(residual.detach().float()))
    return size <= RESIDUAL_SLACK * float(torch.linalg.vector_norm(gradient.float()))
