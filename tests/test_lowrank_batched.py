"""The batched forms of the per-matrix passes compute the same bits as one call per matrix."""

import pytest
import torch

from commhooks import lowrank
from commhooks.error_feedback import ErrorFeedback


def _strided_views(count: int, n: int, m: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Same-shaped matrices at a regular stride in one buffer, a vector between each two."""
    buffer = torch.randn(count * (n * m + 7), generator=gen)
    return [buffer[i * (n * m + 7) : i * (n * m + 7) + n * m].view(n, m) for i in range(count)]


@pytest.mark.parametrize("shape", [(32, 32, 1), (40, 24, 2), (16, 64, 4), (24, 24, 6)])
def test_reconstruct_all_and_products_into_equal_one_call_per_matrix(shape):
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
        assert torch.equal(out[i], alone[0])
