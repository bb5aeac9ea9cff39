"""The blocked routines of lowrank equal the plain formulas across block boundaries."""

import pytest
import torch

from commhooks import lowrank


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    # 3 rows of 10 float32 columns per block: several blocks and a ragged last one.
    monkeypatch.setattr(lowrank, "_BLOCK_BYTES", 3 * 10 * 4)


def _data(n=11, m=10, r=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in ((n, m), (n, m), (r, m))]


@pytest.mark.parametrize("with_error", [True, False])
def test_compensated_left_factor(with_error):
    grad, error, qt = _data()
    matrix = grad.clone()
    out = torch.empty(11, 2, dtype=grad.dtype)
    scratch = torch.empty(lowrank.scratch_elements(matrix), dtype=grad.dtype)
    lowrank.compensated_left_factor_into(matrix, error if with_error else None, qt, out, scratch)
    expected = grad + error if with_error else grad
    torch.testing.assert_close(matrix, expected)
    torch.testing.assert_close(out, expected @ qt.t())


@pytest.mark.parametrize("with_error", [True, False])
def test_compensated_right_factor(with_error):
    grad, error, _ = _data()
    p = torch.randn(11, 2, dtype=grad.dtype)
    matrix = grad.clone()
    out_t = torch.empty(2, 10, dtype=grad.dtype)
    lowrank.compensated_right_factor_into(matrix, error if with_error else None, p, out_t)
    expected = grad + error if with_error else grad
    torch.testing.assert_close(matrix, expected)
    torch.testing.assert_close(out_t, p.t() @ expected)


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


def test_scratch_is_one_block_or_the_whole_matrix():
    assert lowrank.scratch_elements(torch.empty(11, 10)) == 3 * 10
    assert lowrank.scratch_elements(torch.empty(2, 10)) == 2 * 10
