"""The batched forms of the per-matrix passes compute the same bits as one call per matrix."""

import pytest
import torch

from commhooks.compress import lowrank
from commhooks.compress.error_feedback import ErrorFeedback, LazyErrorFeedback


def _strided_views(count: int, n: int, m: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Same-shaped matrices at a regular stride in one buffer, a vector between each two."""
    buffer = torch.randn(count * (n * m + 7), generator=gen)
    return [buffer[i * (n * m + 7) : i * (n * m + 7) + n * m].view(n, m) for i in range(count)]


@pytest.mark.parametrize("whole", [False, True], ids=["cpu", "gpu_branch"])
@pytest.mark.parametrize("shape", [(32, 32, 1), (40, 24, 2), (16, 64, 4), (24, 24, 6)])
def test_reconstruct_all_and_products_into_equal_one_call_per_matrix(shape, whole, monkeypatch):
    # On a GPU's branch (whole matrices) small ones take batched products too; on a CPU their
    # kernel keeps one product's bits per matrix.
    batched = []
    if whole:
        monkeypatch.setattr(lowrank, "_blocked", lambda matrix: False)
        real = lowrank._reconstruct_small_
        spy = lambda *a: batched.append(a[3] is not None) or real(*a)  # noqa: E731
        monkeypatch.setattr(lowrank, "_reconstruct_small_", spy)
    n, m, r = shape
    gen = torch.Generator().manual_seed(n + m + r)
    views = _strided_views(5, n, m, gen)
    p, qt = torch.randn(5, n, r, generator=gen), torch.randn(5, r, m, generator=gen)
    scratch = torch.empty(lowrank.scratch_elements(views[0], r))
    alone = [v.clone() for v in views]
    alone_errors = [torch.empty_like(v) for v in views]
    for i, v in enumerate(alone):
        lowrank.reconstruct_(v, p[i], qt[i], alone_errors[i], scratch)
    errors = [torch.empty_like(v) for v in views]
    lowrank.reconstruct_all_([(views, p, qt)], errors, scratch)
    assert all(torch.equal(a, b) for a, b in zip(views, alone))
    assert all(torch.equal(a, b) for a, b in zip(errors, alone_errors))

    written = [torch.full_like(v, 9.0) for v in views]
    lowrank.products_into([(written, p, qt)])
    for i, out in enumerate(written):
        expected = torch.empty_like(out)
        lowrank.product_into(expected, p[i], qt[i])
        assert torch.equal(out, expected)
    assert batched == ([True, False] if whole else [])  # with errors, then the products alone


def test_unpack_remembering_and_compensate_all_equal_their_per_tensor_forms():
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(5, generator=gen), torch.randn(3, 2, generator=gen)]
    flat = torch.randn(11, generator=gen)
    errors = [torch.empty_like(t) for t in tensors]
    kept = [t.clone() for t in tensors]
    lowrank.unpack_remembering_(flat, tensors, errors)
    assert torch.equal(errors[0], kept[0] - flat[:5])
    assert torch.equal(errors[1], kept[1] - flat[5:].view(3, 2))
    assert torch.equal(torch.cat([t.flatten() for t in tensors]), flat)

    memory = ErrorFeedback("test")
    memory.record(0, torch.randn(5, generator=gen))
    grads = [torch.randn(5, generator=gen), torch.randn(4, generator=gen)]
    before = [g.clone() for g in grads]
    assert memory.compensate_all_([0, 1], grads) == [True, False]
    assert torch.equal(grads[0], before[0] + memory.get(0, grads[0]))
    assert torch.equal(grads[1], before[1])


@pytest.mark.parametrize("shape", [(32, 32, 1), (40, 24, 2), (16, 64, 4)])
def test_q_of_a_strided_stack_equals_one_product_per_matrix(shape):
    # Qᵀ = Pᵀ M over matrices at a regular stride in a bucket, as PowerSGD's runs take them.
    n, m, r = shape
    gen = torch.Generator().manual_seed(n * m * r)
    views = _strided_views(6, n, m, gen)
    offset = views[1].storage_offset() - views[0].storage_offset()
    stack = views[0].as_strided((6, n, m), (offset, m, 1), views[0].storage_offset())
    p = torch.randn(6, n, r, generator=gen)
    out = torch.empty(6, r, m).transpose(1, 2)  # Q stored as Qᵀ
    lowrank.project_([], [(stack, p, out, True)])
    for i, v in enumerate(views):
        alone = torch.empty(1, r, m).transpose(1, 2)
        lowrank.right_factor_into(v.unsqueeze(0), p[i : i + 1], alone)
        if r == 1:
            # One matrix of rank 1 is a matrix-vector product, which BLAS may round otherwise
            # than the stack's (2.9e-6 apart on an AVX-512 CPU); PowerSGD promises 1e-5.
            torch.testing.assert_close(out[i], alone[0], rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(out[i], alone[0])


def _absorb_steps(
    memory: LazyErrorFeedback,
    grads: list[torch.Tensor],
    factors: list[tuple[torch.Tensor, torch.Tensor]],
    together: bool,
) -> list[torch.Tensor]:
    """One single-round step of ``memory`` over ``grads``: absorb (all at once, or one call per
    matrix), then defer ``P Qᵀ``; returns the factors sent."""
    steps, refines = [], []
    for i, (g, (p, qt)) in enumerate(zip(grads, factors)):
        right = i % 2 == 0
        known, sent = (p, torch.empty_like(qt).t()) if right else (qt.t(), torch.empty_like(p))
        steps.append((i, g, known, sent))
        refines.append(right)
    scratch = torch.empty(lowrank.scratch_elements(grads[0], 2))
    if together:
        absorbed = memory.absorb_all_(steps, refines, scratch, finite=True)
    else:
        absorbed = [
            memory.absorb_(k, g, known, sent, right, scratch, finite=True)
            for (k, g, known, sent), right in zip(steps, refines)
        ]
    assert [a.written for a in absorbed] == [g.shape[0] for g in grads]
    sents = [sent for _, _, _, sent in steps]
    for i, (p, qt) in enumerate(factors):
        memory.defer_(i, p, qt)
    return sents


@pytest.mark.parametrize("shape", [(32, 32, 1), (40, 24, 2), (7, 13, 2), (16, 64, 4)])
def test_absorb_all_equals_one_absorb_per_matrix(shape, monkeypatch):
    n, m, r = shape
    gen = torch.Generator().manual_seed(n * m + r)
    passes = []
    real = lowrank.accumulate_factors_
    monkeypatch.setattr(lowrank, "accumulate_factors_", lambda p: passes.append(1) or real(p))
    together, apart = LazyErrorFeedback("test"), LazyErrorFeedback("test")
    together.max_pending_rank = apart.max_pending_rank = 3 * r  # folds every few steps
    for _ in range(7):
        grads = [torch.randn(n, m, generator=gen) for _ in range(5)]
        factors = [
            (torch.randn(n, r, generator=gen), torch.randn(r, m, generator=gen)) for _ in grads
        ]
        mine = _absorb_steps(together, [g.clone() for g in grads], factors, together=True)
        theirs = _absorb_steps(apart, [g.clone() for g in grads], factors, together=False)
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
        assert together.pending_ranks() == apart.pending_ranks()
    assert len(passes) == 7  # each step took the batched pass
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(together.items(), apart.items()))


def _absorb_unchecked(memory, grads, factors, together, stacks=None):
    """One step as on a GPU's branch: the gradients unchecked, every factor in one flat buffer
    marked at once (batched, the gradients zeroed and checked a stack at a time where
    ``stacks`` hold them), or one call per matrix each marking its own factor."""
    from commhooks.compress.error_feedback import mark_non_finite_

    n, m = grads[0].shape
    r = factors[0][0].shape[1]
    flat = torch.zeros(len(grads) * max(n, m) * r)
    steps, refines = [], []
    for i, (g, (p, qt)) in enumerate(zip(grads, factors)):
        right = i % 2 == 0
        room = flat[i * max(n, m) * r :]
        sent = room[: m * r].view(r, m).t() if right else room[: n * r].view(n, r)
        steps.append((i, g, p if right else qt.t(), sent))
        refines.append(right)
    scratch = torch.empty(lowrank.scratch_elements(grads[0], 2))
    if together:
        memory.absorb_all_(steps, refines, scratch, sent_in=flat, stacks=stacks)
    else:
        for (k, g, known, sent), right in zip(steps, refines):
            memory.absorb_(k, g, known, sent, right, scratch, mark=False)
        mark_non_finite_(grads, flat)
    for i, (p, qt) in enumerate(factors):
        memory.defer_(i, p, qt)
    return flat


@pytest.mark.parametrize("shape", [(32, 32, 1), (40, 24, 2), (7, 13, 2)])
def test_absorb_all_on_a_gpus_branch_equals_one_absorb_per_matrix(shape, monkeypatch):
    from commhooks import _reads

    n, m, r = shape
    gen = torch.Generator().manual_seed(n * m + r + 1)
    passes = []
    real = lowrank.accumulate_whole_factors_
    monkeypatch.setattr(
        lowrank, "accumulate_whole_factors_", lambda *a: passes.append(1) or real(*a)
    )
    together, apart = LazyErrorFeedback("test"), LazyErrorFeedback("test")
    zeroed = LazyErrorFeedback("test")  # together, the gradients zeroed a stack at a time
    together.max_pending_rank = apart.max_pending_rank = zeroed.max_pending_rank = 3 * r
    with _reads.as_on_a_gpu():
        for step in range(7):
            grads = [torch.randn(n, m, generator=gen) for _ in range(5)]
            if step == 3:  # a non-finite step: added as zeros there, and every factor marked
                grads[2][1, 1], grads[4][0, 2] = float("inf"), float("nan")
            factors = [
                (torch.randn(n, r, generator=gen), torch.randn(r, m, generator=gen)) for _ in grads
            ]
            mine = _absorb_unchecked(together, [g.clone() for g in grads], factors, True)
            theirs = _absorb_unchecked(apart, [g.clone() for g in grads], factors, False)
            stack = torch.stack(grads)  # the gradients as views of one stack, as a run's
            stacks = [stack[:2], stack[2:]]
            cleaned = _absorb_unchecked(zeroed, list(stack.unbind(0)), factors, True, stacks)
            assert torch.equal(mine.isnan(), theirs.isnan())
            assert torch.equal(mine.nan_to_num(), theirs.nan_to_num())
            assert torch.equal(cleaned.isnan(), theirs.isnan())
            assert torch.equal(cleaned.nan_to_num(), theirs.nan_to_num())
            assert mine.isnan().all() == (step == 3)
            assert together.pending_ranks() == apart.pending_ranks()
    assert len(passes) == 14
    items = zip(together.items(), apart.items(), zeroed.items())
    assert all(
        torch.equal(a, b) and torch.equal(a, c) and torch.isfinite(a).all()
        for (_, a), (_, b), (_, c) in items
    )
