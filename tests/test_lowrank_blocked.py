"""The fused routines of lowrank equal the plain formulas, across block boundaries on CPU and
taking each matrix in one piece as on a GPU (forced here on CPU tensors)."""

import pytest
import torch

from commhooks.compress import lowrank


@pytest.fixture(autouse=True, params=["blocks", "whole"])
def layout(request, monkeypatch):
    # 3 rows of 10 float64 columns per block: several blocks and a ragged last one.
    monkeypatch.setattr(lowrank, "_BLOCK_BYTES", 3 * 10 * 8)
    if request.param == "whole":
        monkeypatch.setattr(lowrank, "_blocked", lambda matrix: False)
    return request.param


def _data(n=11, m=10, r=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in ((n, m), (n, m), (r, m))]


def _pending(n=11, m=10, r=2, with_pending=True):
    if not with_pending:
        return None, torch.zeros(n, m, dtype=torch.float64)
    gen = torch.Generator().manual_seed(7)
    p0 = torch.randn(n, r, generator=gen, dtype=torch.float64)
    q0t = torch.randn(r, m, generator=gen, dtype=torch.float64)
    return (p0, q0t), p0 @ q0t


@pytest.mark.parametrize("with_pending", [True, False])
def test_accumulate_left_factor(with_pending):
    grad, memory, qt = _data()
    pending, product = _pending(with_pending=with_pending)
    expected = memory + grad - product
    out = torch.empty(11, 2, dtype=grad.dtype)
    scratch = torch.empty(lowrank.scratch_elements(grad, 2), dtype=grad.dtype)
    written = lowrank.accumulate_left_factor_(memory, grad, pending, qt, out, scratch)
    assert written == 11
    torch.testing.assert_close(memory, expected)
    torch.testing.assert_close(out, expected @ qt.t())


@pytest.mark.parametrize("with_pending", [True, False])
def test_accumulate_right_factor(with_pending):
    grad, memory, _ = _data()
    pending, product = _pending(with_pending=with_pending)
    p = torch.randn(11, 2, dtype=grad.dtype)
    expected = memory + grad - product
    out_t = torch.empty(2, 10, dtype=grad.dtype)
    scratch = torch.empty(lowrank.scratch_elements(grad, 2), dtype=grad.dtype)
    written = lowrank.accumulate_right_factor_(memory, grad, pending, p, out_t, scratch)
    assert written == 11
    torch.testing.assert_close(memory, expected)
    torch.testing.assert_close(out_t, p.t() @ expected)


@pytest.mark.parametrize("with_pending", [True, False])
@pytest.mark.parametrize("left", [True, False])
def test_accumulation_stops_at_the_first_non_finite_block(left, with_pending, layout):
    grad, memory, qt = _data()
    pending, product = _pending(with_pending=with_pending)
    grad[7, 4] = float("inf")
    first_bad = 7 // lowrank._block_rows(grad) * lowrank._block_rows(grad)  # its block's start
    if layout == "whole":
        first_bad = 0  # the whole matrix is one block
    before = memory.clone()
    scratch = torch.empty(lowrank.scratch_elements(grad, 2), dtype=grad.dtype)
    if left:
        out = torch.empty(11, 2, dtype=grad.dtype)
        written = lowrank.accumulate_left_factor_(memory, grad, pending, qt, out, scratch)
    else:
        out = torch.empty(2, 10, dtype=grad.dtype)
        p = torch.randn(11, 2, dtype=grad.dtype)
        written = lowrank.accumulate_right_factor_(memory, grad, pending, p, out, scratch)
    assert first_bad == written < 11
    expected = before[:written] + grad[:written] - product[:written]
    torch.testing.assert_close(memory[:written], expected)
    assert torch.equal(memory[written:], before[written:])  # the bad block and later: untouched
    assert not torch.isfinite(out).all()  # the factor shows it, on every rank after the sum


@pytest.mark.parametrize("with_pending", [True, False])
@pytest.mark.parametrize("left", [True, False])
def test_unchecked_accumulation_adds_non_finite_elements_as_zeros(left, with_pending):
    # What a GPU does, where reading a check back would stall: every other element is added,
    # and the memory keeps its value where the gradient is not finite.
    grad, memory, qt = _data()
    pending, product = _pending(with_pending=with_pending)
    grad[7, 4], grad[2, 1] = float("inf"), float("nan")
    expected = memory + grad.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0) - product
    scratch = torch.empty(lowrank.scratch_elements(grad, 2), dtype=grad.dtype)
    if left:
        out = torch.empty(11, 2, dtype=grad.dtype)
        written = lowrank.accumulate_left_factor_(memory, grad, pending, qt, out, scratch, False)
        torch.testing.assert_close(out, expected @ qt.t())
    else:
        out = torch.empty(2, 10, dtype=grad.dtype)
        p = torch.randn(11, 2, dtype=grad.dtype)
        written = lowrank.accumulate_right_factor_(memory, grad, pending, p, out, scratch, False)
        torch.testing.assert_close(out, p.t() @ expected)
    assert written == 11
    torch.testing.assert_close(memory, expected)


@pytest.mark.parametrize("left", [True, False])
def test_pending_products_deducted_from_a_thin_factor(left):
    # A factor of M, corrected for products pending on M (stacked, rank 6 here), equals the
    # factor of M minus those products: the memory need not be touched to form it.
    grad, memory, qt = _data()
    pending, product = _pending(r=6)
    p = torch.randn(11, 2, dtype=grad.dtype)
    if left:
        out = memory @ qt.t()
        lowrank.deduct_pending_left_(out, pending, qt)
        torch.testing.assert_close(out, (memory - product) @ qt.t())
    else:
        out_t = p.t() @ memory
        lowrank.deduct_pending_right_(out_t, pending, p)
        torch.testing.assert_close(out_t, p.t() @ (memory - product))


@pytest.mark.parametrize("rank", [1, 2, 4, 6])  # sums of outer products up to 4, then mm
def test_product_and_its_subtraction(rank):
    _, memory, qt = _data(r=rank)
    p = torch.randn(11, rank, dtype=memory.dtype)
    out = torch.full_like(memory, float("nan"))
    lowrank.product_into(out, p, qt)
    torch.testing.assert_close(out, p @ qt)
    expected = memory - p @ qt
    lowrank.subtract_product_(memory, p, qt)
    torch.testing.assert_close(memory, expected)


@pytest.mark.parametrize("with_error", [True, False])
def test_reconstruct(with_error):
    grad, _, qt = _data()
    p = torch.randn(11, 2, dtype=grad.dtype)
    matrix = grad.clone()
    error = torch.full_like(grad, float("nan"))
    scratch = torch.empty(lowrank.scratch_elements(matrix), dtype=grad.dtype)
    lowrank.reconstruct_(matrix, p, qt, error if with_error else None, scratch)
    torch.testing.assert_close(matrix, p @ qt)
    if with_error:
        torch.testing.assert_close(error, grad - p @ qt)
    else:
        assert torch.isnan(error).all()  # untouched


def test_scratch_is_two_blocks_or_twice_the_whole_matrix(layout):
    if layout == "whole":
        assert lowrank.scratch_elements(torch.empty(11, 10, dtype=torch.float64), 2) == 0
        return
    assert lowrank.scratch_elements(torch.empty(11, 10, dtype=torch.float64)) == 2 * 3 * 10
    assert lowrank.scratch_elements(torch.empty(2, 10, dtype=torch.float64)) == 2 * 2 * 10
    # and room for a rank-2 factor of a block (3 rows) or of the matrix (10 columns)
    expected = 2 * 3 * 10 + 2 * 10
    assert lowrank.scratch_elements(torch.empty(11, 10, dtype=torch.float64), 2) == expected


def test_is_finite():
    assert lowrank.is_finite(torch.empty(0))
    assert lowrank.is_finite(torch.randn(5, 4))
    for bad in (float("inf"), float("-inf"), float("nan")):
        t = torch.randn(5, 4)
        t[3, 2] = bad
        assert not lowrank.is_finite(t)
    # finite values whose sum overflows are still finite
    assert lowrank.is_finite(torch.full((4,), torch.finfo(torch.float16).max, dtype=torch.float16))
