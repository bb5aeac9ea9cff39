"""Property-based tests (hypothesis) of the compression math and of the hooks' cast path.

The pure math of :mod:`commhooks.compress.lowrank` is tested in this process. Properties that
need a hook (which needs torch.distributed) run inside one rank started by ``run_on_ranks``: each
check there is a hypothesis test whose outcome ("ok" or the falsifying example's traceback) comes
back here.

Values include zeros, all-zero columns, tiny (1e-30) and huge (1e30) magnitudes; shapes include
1 x N, N x 1, tall and wide; ranks go from 1 to min(n, m) + 1 (capped as the hooks cap them).
Inputs that exposed a defect are pinned with ``@example`` so that they are tried on every run.
"""

import traceback
import warnings

import pytest
import torch
from ddp_utils import FakeBucket
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import commhooks
from commhooks import PowerSGDState, powerSGD_hook
from commhooks.compress import lowrank
from commhooks.testing import run_on_ranks

FAST = settings(
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FLOATS = (torch.float32, torch.float64)
HALVES = (torch.float16, torch.bfloat16)
# |G - I| tolerated in the Gram matrix of an orthogonalised factor of up to 12 rows.
ORTHO_TOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}
# Relative error tolerated where the math is exact up to rounding.
REL_TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}


def extremes(dtype: torch.dtype) -> tuple[float, float]:
    """Tiny and huge magnitudes the dtype holds as normal numbers (1e-30 and 1e30 if it can)."""
    if dtype == torch.float16:
        return 1e-4, 1e4
    return 1e-30, 1e30


def scales(dtype: torch.dtype, extreme: bool) -> list[float]:
    tiny, huge = extremes(dtype)
    base = [0.0, 1.0, 1e-3, 1e3]
    return base + [tiny, huge] if extreme else base


@st.composite
def matrix(
    draw,
    dtypes=FLOATS,
    max_side: int = 12,
    extreme: bool = True,
    zero_columns: bool = True,
    tall: bool = False,
    max_cols: int = 12,
    uniform: bool = False,
):
    """A ``(batch, n, m)`` stack: Gaussian columns, each scaled by one of :func:`scales`."""
    dtype = draw(st.sampled_from(dtypes))
    batch = draw(st.integers(1, 3))
    n = draw(st.integers(1, max_side))
    m = draw(st.integers(1, min(max_cols, n if tall else max_side)))
    pool = scales(dtype, extreme) if zero_columns else scales(dtype, extreme)[1:]
    pool = [1.0] if uniform else pool
    column_scales = draw(st.lists(st.sampled_from(pool), min_size=m, max_size=m))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(batch, n, m, generator=gen, dtype=torch.float64)
    values *= torch.tensor(column_scales, dtype=torch.float64)
    return values.to(dtype)


def _independent_columns(m: torch.Tensor) -> torch.Tensor:
    """``(batch, cols)``: whether each column is nonzero and outside the span of earlier ones."""
    wide = m.double()
    norms = torch.linalg.vector_norm(wide, dim=1)
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))
    _, r = torch.linalg.qr(wide / safe.unsqueeze(1))
    diag = torch.diagonal(r, dim1=1, dim2=2).abs()
    return (norms > 0) & (diag > 1e-6)


def _condition(m: torch.Tensor) -> float:
    """Largest condition number, over the stack, of the nonzero columns scaled to unit norm."""
    worst = 1.0
    for matrix in m.double():
        norms = torch.linalg.vector_norm(matrix, dim=0)
        cols = matrix[:, norms > 0] / norms[norms > 0]
        if cols.shape[1] > 1:
            sv = torch.linalg.svdvals(cols)
            worst = max(worst, (sv[0] / sv[-1]).item() if sv[-1] > 0 else float("inf"))
    return worst


def assert_orthonormal_or_zero(
    out: torch.Tensor, inp: torch.Tensor, conditioned: bool = False
) -> None:
    """Columns are unit or zero, nonzero ones mutually orthogonal, independent inputs nonzero.

    ``conditioned`` widens the tolerance by the input's condition number: Gram-Schmidt's loss of
    orthogonality grows with it, which matters in half precision on well-posed inputs too.
    """
    tol = ORTHO_TOL[out.dtype]
    if conditioned:
        tol = max(tol, 4 * torch.finfo(out.dtype).eps * _condition(inp))
    q = out.double()
    gram = q.transpose(1, 2) @ q
    zero = (q == 0).all(dim=1)  # (batch, cols)
    diag = torch.diagonal(gram, dim1=1, dim2=2)
    unit = (diag - 1).abs() <= tol
    assert (zero | unit).all(), f"columns neither unit nor zero: squared norms {diag.tolist()}"
    keep = (~zero).double()
    off = (gram - torch.diag_embed(diag)) * keep.unsqueeze(1) * keep.unsqueeze(2)
    assert off.abs().max() <= tol, f"nonzero columns not orthogonal: Gram {gram.tolist()}"
    lost = _independent_columns(inp) & zero
    assert not lost.any(), "an independent nonzero input column came out as zeros"


# ----------------------------------------------------------------------------------------------
# lowrank: shapes and views
# ----------------------------------------------------------------------------------------------
@FAST
@given(st.lists(st.integers(1, 5), min_size=0, max_size=4))
def test_as_matrix_is_a_view_with_the_first_dimension_as_rows(shape):
    t = torch.randn(shape)
    m = lowrank.as_matrix(t)
    assert m.dim() == 2 and m.numel() == t.numel()
    assert m.shape[0] == (shape[0] if shape else 1)
    assert m.data_ptr() == t.data_ptr()


def test_as_matrix_of_a_parameter_with_no_elements():
    # A zero-size parameter (e.g. nn.Linear(5, 0)) still reaches the hooks in a bucket.
    assert lowrank.as_matrix(torch.zeros(0, 5)).shape == (0, 5)


@FAST
@given(st.integers(0, 10**7))
def test_square_side_is_the_smallest_square_that_holds(numel):
    side = lowrank.square_side(numel)
    assert side * side >= numel
    assert side == 0 or (side - 1) ** 2 < numel


@FAST
@given(st.integers(1, 4096), st.integers(1, 4096), st.integers(1, 64), st.floats(1, 100))
def test_compression_decision_matches_the_sizes(n, m, rank, rate):
    r = lowrank.effective_rank(n, m, rank)
    assert 1 <= r <= min(n, m, rank)
    full, small = lowrank.compression_sizes(n, m, r)
    assert (full, small) == (n * m, (n + m) * r)
    assert lowrank.should_compress(n, m, r, rate) == (small * rate < full)


@FAST
@given(
    st.lists(st.lists(st.integers(1, 4), min_size=0, max_size=3), min_size=1, max_size=4),
    st.sampled_from(FLOATS + HALVES),
)
def test_pack_then_unpack_round_trips(shapes, dtype):
    tensors = [torch.randn(s).to(dtype) for s in shapes]
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype)
    assert lowrank.pack_into(tensors, flat) is flat
    back = [torch.zeros_like(t) for t in tensors]
    lowrank.unpack_from(flat, back)
    for a, b in zip(tensors, back):
        assert a.shape == b.shape and torch.equal(a, b)


# ----------------------------------------------------------------------------------------------
# lowrank: orthogonalisation
# ----------------------------------------------------------------------------------------------
@FAST
@given(matrix(dtypes=FLOATS + HALVES, tall=True))
def test_orthogonalize_keeps_shape_and_finiteness_in_place(m):
    before = m.clone()
    out = lowrank.orthogonalize_(m)
    assert out is m and m.shape == before.shape and m.dtype == before.dtype
    assert torch.isfinite(m).all(), f"non-finite output from finite input {before.tolist()}"


@FAST
@given(matrix(dtypes=FLOATS + HALVES, tall=True, extreme=False, max_cols=4))
def test_orthogonalize_gives_orthonormal_or_zero_columns(m):
    # Ordinary magnitudes, zero columns included; columns are (almost surely) independent and,
    # as factors are, few: Gram-Schmidt in half precision loses orthogonality on square ones.
    before = m.clone()
    assert_orthonormal_or_zero(lowrank.orthogonalize_(m), before, conditioned=True)


@FAST
@given(matrix(dtypes=FLOATS + (torch.bfloat16,), tall=True, zero_columns=False))
@example(torch.full((1, 4, 1), 1e-30))
@example(torch.tensor([[[1e30, 0.0], [0.0, 1e30], [1e30, 1e30], [0.0, -1e30]]]))
def test_orthogonalize_tiny_and_huge_columns(m):
    # Gradients of 1e-30 or 1e30 are representable in float32 and bfloat16; their squares are not.
    before = m.clone()
    assert_orthonormal_or_zero(lowrank.orthogonalize_(m), before)


@FAST
@given(matrix(dtypes=FLOATS, tall=True, extreme=False, zero_columns=False), st.data())
@example(torch.ones(1, 3, 2), None)
def test_orthogonalize_columns_in_the_span_of_earlier_ones(m, data):
    # A factor P = M Q has dependent columns whenever rank(M) < r: a rank-1 gradient (one
    # sample), or a layer with dead units, compressed at rank 2. The result must still be an
    # orthonormal (or zero) set, or P Pᵀ is no projection and the approximation is wrong.
    if m.shape[2] > 1 and data is not None:
        j = data.draw(st.integers(1, m.shape[2] - 1))
        coef = data.draw(st.sampled_from([1.0, -2.0, 0.5, 3.0]))
        m[:, :, j] = coef * m[:, :, 0]
    before = m.clone()
    assert_orthonormal_or_zero(lowrank.orthogonalize_(m), before)


# ----------------------------------------------------------------------------------------------
# lowrank: one power iteration, as the two-round hook runs it on one rank
# ----------------------------------------------------------------------------------------------
def power_iteration(matrices: torch.Tensor, rank: int, seed: int):
    """``P = M Q``, orthogonalise, ``Q = Mᵀ P``: returns the approximation, P, Q and residual."""
    b, n, m = matrices.shape
    r = lowrank.effective_rank(n, m, rank)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, m, r, generator=gen, dtype=torch.float64).to(matrices.dtype)
    lowrank.orthogonalize_(q)
    p = torch.bmm(matrices, q)
    lowrank.orthogonalize_(p)
    q_new = torch.bmm(matrices.transpose(1, 2), p)
    approx = torch.bmm(p, q_new.transpose(1, 2))
    return approx, p, q_new, matrices - approx


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.double().abs().max().item()
    return 0.0 if scale == 0 else (a.double() - b.double()).abs().max().item() / scale


@FAST
@given(
    matrix(),
    st.sampled_from([0.0, 1e-30, 1.0, 1e30]),
    st.integers(1, 13),
    st.integers(0, 2**31 - 1),
)
def test_error_feedback_identity_of_one_power_iteration(grad, previous_scale, rank, seed):
    gen = torch.Generator().manual_seed(seed)
    previous = torch.randn(grad.shape, generator=gen, dtype=torch.float64) * previous_scale
    compensated = grad + previous.to(grad.dtype)  # what is compressed: gradient + old error
    approx, p, q, new_error = power_iteration(compensated.clone(), rank, seed)
    for t in (approx, p, q, new_error):
        assert torch.isfinite(t).all(), "finite input gave a non-finite factor or result"
    assert approx.shape == grad.shape and new_error.shape == grad.shape
    r = lowrank.effective_rank(grad.shape[1], grad.shape[2], rank)
    assert p.shape == (*grad.shape[:2], r) and q.shape == (grad.shape[0], grad.shape[2], r)
    assert _rel_err(approx + new_error, compensated) <= REL_TOL[grad.dtype]


@FAST
@given(matrix(extreme=False, zero_columns=False, uniform=True), st.integers(0, 2**31 - 1))
def test_full_rank_approximation_reproduces_the_matrix(m, seed):
    # Columns of one scale: well conditioned. Ill-conditioned ones are tested below.
    rank = min(m.shape[1], m.shape[2])
    approx, *_ = power_iteration(m, rank + 1, seed)
    assert _rel_err(approx, m) <= 100 * REL_TOL[m.dtype]


@FAST
@given(matrix(extreme=False, zero_columns=True), st.integers(0, 2**31 - 1))
@example(torch.tensor([[[1.0, 0.0], [2.0, 0.0], [3.0, 0.0], [-1.0, 0.0]]]), 0)
@example((torch.arange(1.0, 7.0).view(6, 1) @ torch.tensor([[1.0, -2.0, 0.5]])).unsqueeze(0), 1)
@example(torch.tensor([[[1.5410e-03, -2.9343e02], [-2.1788e-03, 5.6843e02]]]), 0)
def test_full_rank_approximation_reproduces_rank_deficient_matrices(m, seed):
    # All-zero columns, rank-1 gradients, columns of very different scales: P = M Q has
    # (nearly) dependent columns, and a rank-r approximation (r >= the smaller side) must still
    # give M back.
    rank = min(m.shape[1], m.shape[2])
    approx, *_ = power_iteration(m, rank, seed)
    assert torch.isfinite(approx).all()
    assert _rel_err(approx, m) <= 100 * REL_TOL[m.dtype], "rank-deficient M not reproduced"


# ----------------------------------------------------------------------------------------------
# Properties through the hooks, on one rank
# ----------------------------------------------------------------------------------------------
@st.composite
def bucket_tensors(draw, dtypes=FLOATS):
    """1-3 gradients (vectors, 1 x N, N x 1, tall, wide, 3-D) of one dtype."""
    dtype = draw(st.sampled_from(dtypes))
    shapes = draw(
        st.lists(st.lists(st.integers(1, 12), min_size=1, max_size=3), min_size=1, max_size=3)
    )
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    out = []
    for shape in shapes:
        scale = draw(st.sampled_from(scales(dtype, extreme=True)))
        t = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
        if len(shape) > 1 and draw(st.booleans()):
            t.view(shape[0], -1)[:, 0] = 0  # an all-zero column
        out.append(t.to(dtype))
    return out


def _powersgd_identity(single_round: bool) -> None:
    @FAST
    @given(bucket_tensors(), st.integers(1, 13), st.sampled_from([1, 2]))
    def check(tensors, rank, min_rate):
        state = PowerSGDState(
            None,
            matrix_approximation_rank=rank,
            start_powerSGD_iter=0,
            min_compression_rate=min_rate,
            single_round=single_round,
        )
        bucket = FakeBucket(tensors)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(3):
            grads = [g.clone() for g in bucket.gradients()]
            before = {k: v.clone() for k, v in state.error_dict.items()}
            out = powerSGD_hook(state, bucket).wait()
            assert out.shape == bucket.buffer().shape and out.dtype == grads[0].dtype
            assert torch.isfinite(out).all(), "finite gradients gave a non-finite result"
            for i, (g, approx) in enumerate(zip(grads, bucket.gradients())):
                key = len(grads) - 1 - i  # parameters are numbered from the last
                assert approx.shape == g.shape
                as_m = lowrank.as_matrix(g)
                prev = before.get(key, torch.zeros_like(as_m)).view_as(as_m)
                new = state.error_dict[key].view_as(as_m)
                assert torch.isfinite(new).all(), "the error memory became non-finite"
                total = lowrank.as_matrix(approx) + new
                assert _rel_err(total, as_m + prev) <= REL_TOL[g.dtype], (
                    f"approximation + new error != gradient + previous error for {tuple(g.shape)}"
                )
            fresh = [torch.randn(g.shape, generator=gen, dtype=torch.float64) for g in grads]
            bucket.buffer().copy_(torch.cat([f.reshape(-1) for f in fresh]))

    check()


def _cast_hooks() -> None:
    @FAST
    @given(bucket_tensors(dtypes=FLOATS), st.sampled_from(["fp16", "bf16", "fp16w", "bf16w"]))
    def check(tensors, name):
        hook = {
            "fp16": commhooks.fp16_compress_hook,
            "bf16": commhooks.bf16_compress_hook,
            "fp16w": commhooks.fp16_compress_wrapper(commhooks.allreduce_hook),
            "bf16w": commhooks.bf16_compress_wrapper(commhooks.allreduce_hook),
        }[name]
        bucket = FakeBucket(tensors)
        x = bucket.buffer().clone()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = hook(None, bucket).wait()
        assert out.shape == x.shape
        if name.endswith("w"):  # as PyTorch's wrappers: the low-precision copy; DDP casts back
            low = torch.float16 if name == "fp16w" else torch.bfloat16
            assert out.dtype == low, name
            out = out.to(x.dtype)
        else:
            assert out.dtype == x.dtype
        # World size 1: the value cast through the dtype, inf where it overflows, as PyTorch's.
        low = torch.float16 if name.startswith("fp16") else torch.bfloat16
        expected = x.to(low).to(x.dtype)
        assert torch.equal(out, expected), f"{name}: not the value cast through its dtype"

    check()


def _rank_deficient_gradient() -> None:
    # A rank-1 gradient (one sample through a linear layer) compressed at rank 2 is exactly
    # representable, so the hook must give it back; no error feedback to hide the difference.
    u = torch.arange(1.0, 17.0).view(16, 1)
    v = torch.linspace(-1.0, 1.0, 12).view(1, 12)
    grad = u @ v
    errors = {}
    for single_round in (False, True):
        state = PowerSGDState(
            None,
            matrix_approximation_rank=2,
            start_powerSGD_iter=0,
            use_error_feedback=False,
            single_round=single_round,
        )
        bucket = FakeBucket([grad])  # the same parameters every step, as DDP hands them
        for step in range(2):
            bucket.buffer().copy_(grad.view(-1))
            out = powerSGD_hook(state, bucket).wait().view(16, 12)
            # One round refines P first (M Q Qᵀ with a random Q): only its Q step is exact.
            if step == 1 or not single_round:
                errors[f"single_round={single_round} step {step}"] = _rel_err(out, grad)
    assert all(e < 1e-4 for e in errors.values()), f"relative errors {errors}"


def _run_checks(rank: int, world_size: int) -> dict[str, str]:
    checks = {
        "powersgd-rank-deficient": _rank_deficient_gradient,
        "powersgd-two-round": lambda: _powersgd_identity(False),
        "powersgd-single-round": lambda: _powersgd_identity(True),
        "cast-hooks": _cast_hooks,
    }
    out = {}
    for name, check in checks.items():
        try:
            check()
            out[name] = "ok"
        except Exception:
            out[name] = traceback.format_exc()[-6000:]
    return out


@pytest.fixture(scope="module")
def hook_properties():
    return run_on_ranks(_run_checks, 1, timeout=150)[0]


@pytest.mark.parametrize("variant", ["two-round", "single-round"])
def test_powersgd_error_feedback_identity_through_the_hook(hook_properties, variant):
    result = hook_properties[f"powersgd-{variant}"]
    assert result == "ok", result


def test_cast_path_of_the_default_hooks(hook_properties):
    result = hook_properties["cast-hooks"]
    assert result == "ok", result


def test_powersgd_gives_back_a_gradient_of_lower_rank_than_its_factors(hook_properties):
    result = hook_properties["powersgd-rank-deficient"]
    assert result == "ok", result
