"""PowerSGD hooks against PyTorch's (the oracle) and where PyTorch's break, gloo, 2-3 ranks."""

import contextlib
import logging
import math
import pickle
import warnings
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist
from ddp_utils import (
    FakeBucket,
    batches,
    count_buckets,
    flat_grads,
    flat_params,
    make_ddp,
    make_mlp,
    train,
)
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.utils._python_dispatch import TorchDispatchMode

import commhooks
from commhooks import PowerSGDState, _reads, batched_powerSGD_hook, powerSGD_hook
from commhooks.compress import lowrank
from commhooks.compress.error_feedback import LazyErrorFeedback
from commhooks.testing import run_on_ranks

ONE_BUCKET = 100  # bucket_cap_mb: the whole model in one bucket


def _grads_per_step(ddp, data, lr=0.05):
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    out = []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        out.append(flat_grads(ddp.module))
        opt.step()
    return torch.stack(out)


CONFIGS = [
    dict(matrix_approximation_rank=rank, warm_start=warm)
    for rank in (1, 3)
    for warm in (True, False)
]  # rank 1: Gram-Schmidt; rank 3: QR
CONFIGS.append(dict(matrix_approximation_rank=2))  # Gram-Schmidt over two columns
# Two 48 x 48 layers, compressed with one batched product when asked to.
CONFIGS.append(dict(matrix_approximation_rank=2, batch_tensors_with_same_shape=True))
SAME_SHAPES = (32, 48, 48, 48, 8)


def _against_pytorch(rank, world_size, steps):
    data = batches(rank, steps)
    out = []
    for options in CONFIGS:
        ours = PowerSGDState(None, start_powerSGD_iter=2, **options)
        theirs = torch_powersgd.PowerSGDState(None, start_powerSGD_iter=2, **options)
        widths = SAME_SHAPES if options.get("batch_tensors_with_same_shape") else None
        model = make_mlp(widths=widths) if widths else make_mlp()
        a = _grads_per_step(make_ddp(model, powerSGD_hook, ours, ONE_BUCKET), data)
        model = make_mlp(widths=widths) if widths else make_mlp()
        hook = torch_powersgd.powerSGD_hook
        b = _grads_per_step(make_ddp(model, hook, theirs, ONE_BUCKET), data)
        out.append((a, b, ours.compression_stats(), theirs.compression_stats()))
    return out


def test_same_numerics_as_pytorch_on_one_bucket():
    for per_rank in run_on_ranks(_against_pytorch, 2, 20):
        for options, (ours, theirs, our_stats, their_stats) in zip(CONFIGS, per_rank):
            relative = (ours - theirs).norm(dim=1) / theirs.norm(dim=1)
            assert float(relative.max()) <= 1e-5, (options, relative)
            assert our_stats == their_stats, options
            assert our_stats[0] > 1.5, options  # compression really ran


# Buckets called one after another, the first with vectors only: PyTorch's hook still draws a
# seed for it, so every later bucket starts from the projection it would get there.
BUCKET_SHAPES = [[(8,)], [(16, 12), (12,)], [(20, 6), (6, 5)]]
BUCKET_CONFIGS = [
    dict(matrix_approximation_rank=1),
    dict(matrix_approximation_rank=2, warm_start=False),
    dict(matrix_approximation_rank=3),
]


def _bucket_by_bucket(rank, world_size, steps):
    gen = torch.Generator().manual_seed(rank)
    data = [
        [
            torch.cat([torch.randn(s, generator=gen).flatten() for s in shapes])
            for shapes in BUCKET_SHAPES
        ]
        for _ in range(steps)
    ]
    out = []
    for options in BUCKET_CONFIGS:
        pair = []
        ours = PowerSGDState(None, start_powerSGD_iter=2, **options)
        theirs = torch_powersgd.PowerSGDState(None, start_powerSGD_iter=2, **options)
        for hook, state in ((powerSGD_hook, ours), (torch_powersgd.powerSGD_hook, theirs)):
            last = len(BUCKET_SHAPES) - 1
            buckets = [
                FakeBucket([torch.zeros(s) for s in shapes], index=i, last=i == last)
                for i, shapes in enumerate(BUCKET_SHAPES)
            ]
            got = []
            for step in data:
                for bucket, flat in zip(buckets, step):
                    bucket.buffer().copy_(flat)
                    got.append(hook(state, bucket).wait().clone())
            pair.append(torch.cat(got))
        out.append(pair)
    return out


def test_same_numerics_as_pytorch_over_several_buckets():
    for per_rank in run_on_ranks(_bucket_by_bucket, 2, 6):
        for options, (ours, theirs) in zip(BUCKET_CONFIGS, per_rank):
            relative = (ours - theirs).norm() / theirs.norm()
            assert float(relative) <= 1e-5, (options, float(relative))


def _many_buckets(rank, world_size, steps, repeats):
    data = batches(rank, steps)
    out = []
    for single_round in [False, True] * repeats:
        hook, seen = count_buckets(powerSGD_hook)
        state = PowerSGDState(
            None, start_powerSGD_iter=0, matrix_approximation_rank=2, single_round=single_round
        )
        ddp = make_ddp(make_mlp(widths=(32, 48, 48, 48, 40, 8)), hook, state, bucket_cap_mb=0.004)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.02)
        for x, y in data:
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        out.append((flat_params(ddp.module), len(seen), state.iter))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_many_buckets_never_mismatch_collectives(world_size):
    # PyTorch's hook aborts here with a gloo collective mismatch (its follow-ups are issued from
    # callbacks); ours orders them. Both variants, twice each: a race shows now and then.
    results = run_on_ranks(_many_buckets, world_size, 50, 2)
    for run, (params, buckets, steps) in enumerate(results[0]):
        assert buckets >= 4 and steps == 50
        assert torch.isfinite(params).all()
        for other in results[1:]:
            assert torch.equal(other[run][0], params)


def _count_collectives(rank, world_size, single_round, monkeypatch_steps):
    calls = []
    # Two gloo ranks sum small tensors by sending them to each other (see comm.allreduce):
    # count both.
    names = ("all_reduce", "all_gather_single", "all_gather_into_tensor", "isend")
    real = {name: getattr(dist, name) for name in names if hasattr(dist, name)}

    def counting(name):
        def counted(first, *args, **kwargs):
            calls.append((first if name in ("all_reduce", "isend") else args[0]).numel())
            return real[name](first, *args, **kwargs)

        return counted

    data = batches(rank, monkeypatch_steps)
    state = PowerSGDState(None, start_powerSGD_iter=0, single_round=single_round)
    hook, seen = count_buckets(powerSGD_hook)
    ddp = make_ddp(make_mlp(), hook, state, bucket_cap_mb=0.004)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.02)
    x, y = data[0]
    torch.nn.functional.mse_loss(ddp(x), y).backward()  # step 1: DDP's initial single bucket
    opt.step()
    counted_before = state.compression_stats()[2]
    for name in real:
        setattr(dist, name, counting(name))
    try:
        for x, y in data[1:]:
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    stats = state.compression_stats()[2] - counted_before
    return len(calls), len(seen), sum(calls), sum(p.numel() for p in ddp.parameters()), stats


def _count_both(rank, world_size, steps):
    return [_count_collectives(rank, world_size, single, steps) for single in (True, False)]


def test_single_round_sends_one_collective_per_bucket():
    steps = 5
    single, double = run_on_ranks(_count_both, 2, steps)[0]
    one, buckets, one_numel, total, one_stats = single
    two, _, two_numel, _, two_stats = double
    assert one == buckets * (steps - 1)
    assert two >= 2 * buckets * (steps - 1)  # P and Q per bucket, plus uncompressed tensors
    assert one_numel < two_numel < total * (steps - 1) / 2  # and both compress
    # compression_stats() counts what was sent: one factor a step for the single round.
    assert (one_stats, two_stats) == (one_numel, two_numel)


def _batched(rank, world_size, ours):
    data = batches(rank, 8)
    if ours:
        state, hook = PowerSGDState(None, start_powerSGD_iter=0), batched_powerSGD_hook
    else:
        state = torch_powersgd.PowerSGDState(None, start_powerSGD_iter=2)
        hook = torch_powersgd.batched_powerSGD_hook
    ddp = make_ddp(make_mlp(), hook, state, bucket_cap_mb=0.004)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.02)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in data:
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
    return flat_params(ddp.module), [str(w.message) for w in caught], state.compression_stats()


def _batched_both(rank, world_size):
    ours = _batched(rank, world_size, True)
    try:
        _batched(rank, world_size, False)
    except Exception as exc:  # PyTorch's hook fails inside backward
        return ours, f"{type(exc).__name__}: {exc}"
    return ours, None


def test_batched_hook_works_on_gloo_where_pytorchs_fails():
    results = run_on_ranks(_batched_both, 2)
    (params, messages, stats), failure = results[0]
    assert torch.isfinite(params).all() and torch.equal(params, results[1][0][0])
    assert not torch.equal(params, flat_params(make_mlp()))
    assert stats[0] > 1
    # Compression from step 0: DDP's rebuild after step 1 changes bucket 0, whose state resets.
    assert any("now holds other parameters" in m for m in messages)
    assert failure is not None and "AssertionError" in failure


def _zero_layer(rank, world_size, ours, device="cpu"):
    torch.manual_seed(rank)
    zero, other = torch.zeros(16, 12), torch.randn(16, 12)
    bucket = FakeBucket([zero, other], device=device)
    if ours:
        state, hook = PowerSGDState(None, start_powerSGD_iter=0), powerSGD_hook
    else:
        state = torch_powersgd.PowerSGDState(
            None, start_powerSGD_iter=0, use_error_feedback=False, warm_start=False
        )
        hook = torch_powersgd.powerSGD_hook
    out = hook(state, bucket).wait()
    return out[: zero.numel()].clone(), out[zero.numel() :].clone()


def _zero_then_learn(rank, world_size, approximation_rank, single_round, device="cpu"):
    """A layer's gradient vanishes for one step, then comes back: so must its compression."""
    gen = torch.Generator().manual_seed(rank)
    bucket = FakeBucket([torch.zeros(16, 12), torch.zeros(16, 12)], device=device)
    state = PowerSGDState(
        None,
        start_powerSGD_iter=0,
        matrix_approximation_rank=approximation_rank,
        single_round=single_round,
    )
    sizes = []
    for step in range(4):
        layer = torch.zeros(16, 12) if step == 0 else torch.randn(16, 12, generator=gen)
        bucket.buffer().copy_(torch.cat([layer.flatten(), torch.randn(192, generator=gen)]))
        out = powerSGD_hook(state, bucket).wait()
        sizes.append(float(out[:192].abs().sum()))
    return sizes


def _fake_bucket_checks(rank, world_size):
    return {
        "zero": _zero_layer(rank, world_size, True),
        "zero-then-learn": [
            _zero_then_learn(rank, world_size, r, single)
            for r, single in ((1, False), (2, False), (3, False), (2, True))
        ],
        "zero-pytorch": _zero_layer(rank, world_size, False),
        "error-feedback": [_error_feedback(rank, world_size, single) for single in (False, True)],
        "full-rank": _full_rank(rank, world_size),
        "non-finite": [_non_finite(rank, world_size, single) for single in (False, True)],
        "non-finite-unchecked": _non_finite_unchecked(rank, world_size),
        "non-finite-unchecked-several": _non_finite_unchecked_among_several(rank, world_size),
        "gpu-paths": _gpu_paths(rank, world_size),
    }


@pytest.fixture(scope="module")
def fake_bucket_results():
    """Hook calls on chosen tensors, all in one launch of 2 ranks."""
    return run_on_ranks(_fake_bucket_checks, 2)


def test_zero_gradient_layer_gives_zeros_not_nan(fake_bucket_results):
    for per_rank in fake_bucket_results:
        zero, other = per_rank["zero"]
        assert torch.equal(zero, torch.zeros_like(zero))
        assert torch.isfinite(other).all() and other.abs().sum() > 0
        zero, _ = per_rank["zero-pytorch"]
        assert torch.isnan(zero).all()  # PyTorch's hook with the default epsilon


def _error_feedback(rank, world_size, single_round, device="cpu"):
    gen = torch.Generator().manual_seed(rank)
    shapes = [(16, 12), (12,), (20, 3, 2), (16, 12)]
    bucket = FakeBucket([torch.randn(s, generator=gen) for s in shapes], device=device)
    state = PowerSGDState(None, start_powerSGD_iter=0, single_round=single_round)
    checked = 0
    for _ in range(4):
        grads = [g.clone() for g in bucket.gradients()]
        before = {k: v.clone() for k, v in state.error_dict.items()}
        powerSGD_hook(state, bucket).wait()
        for i, (g, approx) in enumerate(zip(grads, bucket.gradients())):
            n, ordinal = g.shape[0], len(grads) - 1 - i  # parameters are numbered from the last
            if lowrank.should_compress(n, g.numel() // n, 1, 2):
                prev = before.get(ordinal, torch.zeros_like(g.view(n, -1)))
                new = state.error_dict[ordinal]
                torch.testing.assert_close(approx.view(n, -1) + new, g.view(n, -1) + prev)
                checked += 1
        bucket.buffer().copy_(torch.randn(bucket.buffer().shape, generator=gen))
    return checked


def test_error_feedback_identity(fake_bucket_results):
    for per_rank in fake_bucket_results:
        assert per_rank["error-feedback"] == [4 * 3, 4 * 3]  # both variants, every matrix


def _full_rank(rank, world_size):
    gen = torch.Generator().manual_seed(rank)
    tensors = [torch.randn(8, 5, generator=gen), torch.randn(5, generator=gen)]
    tensors.append(torch.randn(6, 2, 3, generator=gen))
    state = PowerSGDState(None, matrix_approximation_rank=8, start_powerSGD_iter=0)
    # Below 1 only here, so that full-rank factors (larger than the matrix) are really used.
    object.__setattr__(state.settings, "min_compression_rate", 0.5)
    bucket = FakeBucket(tensors)
    expected = bucket.buffer().clone()
    dist.all_reduce(expected)
    out = powerSGD_hook(state, bucket).wait()
    return out, expected / world_size, len(state.q_memory_dict)


def test_full_rank_equals_plain_allreduce(fake_bucket_results):
    for per_rank in fake_bucket_results:
        out, expected, compressed = per_rank["full-rank"]
        assert compressed == 2
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def _non_finite(rank, world_size, single_round, device="cpu", shapes=((16, 12), (12,)), bad=3):
    gen = torch.Generator().manual_seed(rank)
    tensors = [torch.randn(shape, generator=gen) for shape in shapes]
    bucket = FakeBucket(tensors, device=device)
    state = PowerSGDState(None, start_powerSGD_iter=0, single_round=single_round)
    powerSGD_hook(state, bucket).wait()
    saved = {k: v.clone() for k, v in state.error_dict.items()}
    factors = {k: v.clone() for k, v in state.q_memory_dict.items()}
    local = torch.randn(bucket.buffer().shape, generator=gen)
    if rank == 0:
        local[bad] = float("inf")
    bucket.buffer().copy_(local)
    out = powerSGD_hook(state, bucket).wait()
    errors = state.error_dict
    unchanged = saved.keys() == errors.keys() and all(
        torch.equal(factors[k], state.q_memory_dict[k]) for k in factors
    )
    # Largest change of the error memory, relative to the finite gradient's scale.
    scale = local[torch.isfinite(local)].abs().max()
    drift = max((saved[k] - errors[k]).abs().max().item() for k in saved) / scale
    exact = all(torch.equal(saved[k], errors[k]) for k in saved)
    return bool(torch.isfinite(out).all()), unchanged, out, exact, float(drift)


@contextlib.contextmanager
def _as_on_a_gpu():
    """CPU tensors take a GPU's paths: whole matrices, and no check read back to the host."""
    with mock.patch.object(lowrank, "_blocked", lambda matrix: False), _reads.as_on_a_gpu():
        yield


def _non_finite_unchecked(rank, world_size):
    with _as_on_a_gpu():
        return _non_finite(rank, world_size, True)


# Three matrices compressed alone, the inf in the second: its factors are marked once for the
# bucket (error_feedback.mark_non_finite_).
SEVERAL_ALONE = ((16, 12), (12,), (20, 6), (10, 10))
BAD_IN_THE_SECOND = 16 * 12 + 12 + 5


def _non_finite_unchecked_among_several(rank, world_size):
    with _as_on_a_gpu():
        return _non_finite(rank, world_size, True, shapes=SEVERAL_ALONE, bad=BAD_IN_THE_SECOND)


def _gpu_paths(rank, world_size):
    with _as_on_a_gpu():
        return [_error_feedback(rank, world_size, single) for single in (False, True)]


def test_error_feedback_identity_on_a_gpu_s_paths(fake_bucket_results):
    for per_rank in fake_bucket_results:
        assert per_rank["gpu-paths"] == [4 * 3, 4 * 3]


def test_non_finite_gradient_unchecked_keeps_error_memory_to_rounding(fake_bucket_results):
    # Non-finite elements are added as zeros and the factor is marked NaN on the device: every
    # rank falls back, and every rank's memory is the old one to the rounding of one addition,
    # the rank whose gradient held the inf included.
    for per_rank in fake_bucket_results:
        finite, unchanged, out, _, drift = per_rank["non-finite-unchecked"]
        assert not finite and unchanged
        assert drift < 1e-6
        assert torch.isinf(out[3]) and torch.isfinite(torch.cat([out[:3], out[4:]])).all()


def test_one_non_finite_matrix_among_several_unchecked_sends_the_bucket_again(
    fake_bucket_results,
):
    # On a GPU's branch the bucket's factors are marked at once: one matrix's inf makes the
    # whole step fall back, and no memory takes more than the rounding of one addition.
    for per_rank in fake_bucket_results:
        finite, unchanged, out, _, drift = per_rank["non-finite-unchecked-several"]
        assert not finite and unchanged
        assert drift < 1e-6
        bad = BAD_IN_THE_SECOND
        assert (
            torch.isinf(out[bad]) and torch.isfinite(torch.cat([out[:bad], out[bad + 1 :]])).all()
        )


def test_a_layer_learns_again_after_a_zero_gradient(fake_bucket_results):
    # With warm start, a zero Q would stay zero (M·0 = 0): the layer would get zeros forever.
    for per_rank in fake_bucket_results:
        for sizes in per_rank["zero-then-learn"]:
            assert sizes[0] == 0.0
            assert all(math.isfinite(x) and x > 0 for x in sizes[1:]), sizes


def test_non_finite_gradient_keeps_error_memory_clean(fake_bucket_results):
    for rank, per_rank in enumerate(fake_bucket_results):
        for single, (finite, unchanged, _, exact, drift) in enumerate(per_rank["non-finite"]):
            assert not finite and unchanged  # the overflow shows on every rank; memory is kept
            if single and rank == 1:
                # A rank with a finite gradient added it into the memory during the collective
                # and took it back out: the memory is the old one to the rounding of that.
                assert drift < 1e-6
            else:  # the two-round variant, and the rank whose gradient was not finite
                assert exact
        # Both variants send the bucket again as plain allreduce would: inf where it was.
        for _, _, out, _, _ in per_rank["non-finite"]:
            assert torch.isinf(out[3]) and torch.isfinite(torch.cat([out[:3], out[4:]])).all()


def _lazy_memory(rank, world_size):
    """The single-round memory, kept lazily, behaves as if it were an error every step."""
    lowrank._BLOCK_BYTES = 4 * 12 * 4  # 4 rows of the 16 x 12 matrix per block
    LazyErrorFeedback.max_pending_rank = 3  # rank 1: fold the pending products every 3rd step
    gen = torch.Generator().manual_seed(rank)
    shapes = [(16, 12), (12,), (20, 6)]
    numel = sum(torch.Size(s).numel() for s in shapes)
    steps = [torch.randn(numel, generator=gen) for _ in range(9)]
    looked, unlooked = (PowerSGDState(None, start_powerSGD_iter=0, single_round=True) for _ in "ab")
    buckets = {id(s): FakeBucket([torch.zeros(s) for s in shapes]) for s in (looked, unlooked)}
    outputs = {"looked": [], "unlooked": []}
    pending_ranks = []
    for grad in steps:
        for name, state in (("looked", looked), ("unlooked", unlooked)):
            bucket = buckets[id(state)]
            bucket.buffer().copy_(grad)
            outputs[name].append(powerSGD_hook(state, bucket).wait().clone())
            if name == "looked":
                _ = state.error_dict  # every step: the memory is turned into errors
        pending_ranks.append(sorted(unlooked.memory.pending_ranks().values()))
    kept_lazily = len(unlooked.memory.pending_ranks())
    errors = (looked.error_dict, pickle.loads(pickle.dumps(unlooked)).error_dict)
    bucket = buckets[id(unlooked)]

    def bad_step():
        """A NaN in the third block of rank 0's 16 x 12 matrix: the step is undone."""
        before = pickle.loads(pickle.dumps(unlooked))  # the lazy form, to compare with later
        bad = steps[0].clone()
        if rank == 0:
            bad[9 * 12 + 5] = float("nan")
        bucket.buffer().copy_(bad)
        out = powerSGD_hook(unlooked, bucket).wait()
        kept = all(
            torch.equal(before.q_memory_dict[k], unlooked.q_memory_dict[k])
            for k in before.q_memory_dict
        )
        ranks = sorted(unlooked.memory.pending_ranks().values())
        after = {k: v.clone() for k, v in unlooked.error_dict.items()}  # later steps write it
        return before.error_dict, after, bool(torch.isfinite(out).all()), kept, ranks

    # The products pending have rank 3 after 9 steps: the next step folds them in, and the
    # memory of the rows it did not reach is made an error when the step is undone.
    fold = bad_step()
    bucket.buffer().copy_(steps[1])
    powerSGD_hook(unlooked, bucket).wait()  # pending rank 1: the next step does not fold
    no_fold = bad_step()
    return {
        "outputs": outputs,
        "kept_lazily": kept_lazily,
        "pending_ranks": pending_ranks,
        "errors": errors,
        "bad_steps": (fold, no_fold),
    }


def _small_matrices_memory(rank, world_size, block_bytes):
    """Single-round steps, with blocks of ``block_bytes``: per step, the shapes of the matrices
    left with a product pending, and whether each matrix's memory is, to the bit, its old error
    plus its gradient less the approximation the step wrote into the bucket."""
    lowrank._BLOCK_BYTES = block_bytes
    shapes = [(16, 12), (12,), (20, 6)]
    places = {shapes[0]: 0, shapes[2]: 16 * 12 + 12}  # where each matrix is in the bucket
    state = PowerSGDState(None, start_powerSGD_iter=0, single_round=True)
    bucket = FakeBucket([torch.zeros(s) for s in shapes])
    gen = torch.Generator().manual_seed(rank)
    old = {shape: torch.zeros(shape) for shape in places}
    seen = []
    for _ in range(4):
        grad = torch.randn(bucket.buffer().numel(), generator=gen)
        bucket.buffer().copy_(grad)
        out = powerSGD_hook(state, bucket).wait()
        pending = set(state.memory.pending_ranks())  # reading the memory subtracts them
        memory = {key: tensor.clone() for key, tensor in state.memory.items()}
        errors = {tuple(e.shape): e for e in memory.values() if e.dim() == 2}
        exact = {}
        for shape, at in places.items():
            g, approx = (t[at : at + math.prod(shape)].view(shape) for t in (grad, out))
            exact[shape] = torch.equal(errors[shape], (old[shape] + g) - approx)
        seen.append(({tuple(memory[k].shape) for k in pending}, exact))
        old = errors
    return seen


def test_single_round_takes_small_matrices_products_out_of_their_memory_at_once():
    for per_rank in run_on_ranks(_small_matrices_memory, 2, lowrank._BLOCK_BYTES):
        for pending, exact in per_rank:
            assert pending == set() and exact == {(16, 12): True, (20, 6): True}
    # Blocks of 480 bytes: the 16 x 12 matrix (768 bytes) takes two and keeps its product
    # pending; the 20 x 6 one (480 bytes) fits one and has its product subtracted at once.
    for per_rank in run_on_ranks(_small_matrices_memory, 2, 480):
        for pending, exact in per_rank:
            assert pending == {(16, 12)} and exact[(20, 6)]


def test_lazy_memory_matches_an_error_memory_and_survives_a_bad_step():
    for per_rank in run_on_ranks(_lazy_memory, 2):
        assert per_rank["kept_lazily"] == 2  # both matrices
        # Products pile up to rank 3, then are subtracted in the pass of the next step.
        assert [r[0] for r in per_rank["pending_ranks"]] == [1, 2, 3, 1, 2, 3, 1, 2, 3]
        # The same sums in another order: float32 rounding, whose size depends on the CPU's
        # kernels (a difference of 2.6e-6 on an output of 0.13 was seen on one machine).
        for a, b in zip(per_rank["outputs"]["looked"], per_rank["outputs"]["unlooked"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        looked, unlooked = per_rank["errors"]
        assert looked.keys() == unlooked.keys()
        for k in looked:  # the same sums in another order: rounding of values of order 1
            torch.testing.assert_close(looked[k], unlooked[k], rtol=1e-5, atol=1e-5)
        (*_, fold_ranks), (*_, no_fold_ranks) = per_rank["bad_steps"]
        assert fold_ranks == [] and no_fold_ranks == [1, 1]
        for before, after, finite, kept, _ in per_rank["bad_steps"]:
            assert not finite and kept
            assert before.keys() == after.keys()
            for k in before:  # the step was undone: every rank has its memory back
                torch.testing.assert_close(after[k], before[k], rtol=1e-6, atol=1e-6)


def _wrapped(rank, world_size, wrapper):
    data = batches(rank, 6)
    state = PowerSGDState(None, start_powerSGD_iter=0, matrix_approximation_rank=2)
    ddp = make_ddp(make_mlp(), wrapper(powerSGD_hook), state)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.02)
    losses = []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return flat_params(ddp.module), state.error_dict[0].dtype


def _both_wrappers(rank, world_size):
    wrappers = (commhooks.fp16_compress_wrapper, commhooks.bf16_compress_wrapper)
    return [_wrapped(rank, world_size, w) for w in wrappers]


def test_cast_wrappers_compose_with_powersgd():
    results = run_on_ranks(_both_wrappers, 2)
    for i, dtype in enumerate((torch.float16, torch.bfloat16)):
        params, error_dtype = results[0][i]
        assert torch.isfinite(params).all() and torch.equal(params, results[1][i][0])
        assert not torch.equal(params, flat_params(make_mlp()))
        assert error_dtype == dtype


def _ordinals(rank, world_size, cap):
    model = make_mlp()
    state = PowerSGDState(None, start_powerSGD_iter=5)
    ddp = make_ddp(model, powerSGD_hook, state, bucket_cap_mb=cap)
    x, y = batches(rank, 1)[0]
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    return [state.numbering.number_of(p) for p in model.parameters()]


def _start_at_one(rank, world_size, single_round):
    """Compression from step 1: the first compressed step already sees DDP's rebuilt buckets."""
    state = PowerSGDState(None, start_powerSGD_iter=1, single_round=single_round)
    model = make_mlp()
    ddp = make_ddp(model, powerSGD_hook, state, bucket_cap_mb=0.004)
    train(ddp, batches(rank, 6))
    ordinal = {state.numbering.numbers([p])[0]: p for p in model.parameters()}
    fits = all(e.numel() == ordinal[k].numel() for k, e in state.error_dict.items())
    return flat_params(model), state.compression_stats()[0], len(state.error_dict), fits


def _misc(rank, world_size):
    return {
        "start-one": [_start_at_one(rank, world_size, single) for single in (False, True)],
        "ordinals": [_ordinals(rank, world_size, cap) for cap in (0.004, ONE_BUCKET)],
        "logging": _logging(rank, world_size),
        "register": _register(rank, world_size),
    }


@pytest.fixture(scope="module")
def misc_results():
    return run_on_ranks(_misc, 2)


def test_start_at_step_one_works_across_the_bucket_rebuild(misc_results):
    # PyTorch refuses start_powerSGD_iter=1 with error feedback: its state is keyed by bucket.
    for run in range(2):
        params, rate, errors, fits = misc_results[0]["start-one"][run]
        assert torch.isfinite(params).all() and not torch.equal(params, flat_params(make_mlp()))
        assert torch.equal(params, misc_results[1]["start-one"][run][0])
        assert rate > 1 and errors > 0 and fits


def test_parameter_ordinals_do_not_depend_on_bucket_size(misc_results):
    # The error memory is keyed by these numbers: a resumed run (maybe with other bucket sizes)
    # must number parameters exactly as the original did.
    small, large = misc_results[0]["ordinals"]
    assert small == large and sorted(small) == list(range(len(small)))


def _logging(rank, world_size):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("commhooks.hooks.powersgd")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    state = PowerSGDState(None, start_powerSGD_iter=0, compression_stats_logging_frequency=3)
    ddp = make_ddp(make_mlp(), powerSGD_hook, state, bucket_cap_mb=ONE_BUCKET)
    for x, y in batches(rank, 7):
        torch.nn.functional.mse_loss(ddp(x), y).backward()
    stats = [r.getMessage() for r in records if "compression stats" in r.getMessage()]
    return stats, state.compression_stats()


def test_compression_stats_are_logged_every_n_steps(misc_results):
    stats, (rate, before, after) = misc_results[0]["logging"]
    assert len(stats) == 3  # steps 0, 3, 6
    assert before == 7 * sum(p.numel() for p in make_mlp().parameters())
    assert rate == pytest.approx(before / after) and rate > 2


def _register(rank, world_size):
    ddp = make_ddp(make_mlp())
    state = commhooks.register(ddp, "power_sgd_single_round", start_powerSGD_iter=0)
    for x, y in batches(rank, 3):
        torch.nn.functional.mse_loss(ddp(x), y).backward()
    return state.single_round, state.iter, flat_grads(ddp.module)


def test_register_by_name(misc_results):
    results = [r["register"] for r in misc_results]
    assert results[0][:2] == (True, 3)
    assert torch.equal(results[0][2], results[1][2])
    spec = commhooks.config.hook_spec("power_sgd")
    assert spec.hook is powerSGD_hook and "single_round" in spec.options
    assert "process_group" not in spec.options
    assert commhooks.config.hook_spec("batched_power_sgd").hook is batched_powerSGD_hook


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(matrix_approximation_rank=0), "matrix_approximation_rank must be an integer >= 1"),
        (dict(matrix_approximation_rank=1.5), "matrix_approximation_rank"),
        (dict(start_powerSGD_iter=-1), "start_powerSGD_iter must be an integer >= 0"),
        (dict(min_compression_rate=0.5), "min_compression_rate must be a number >= 1"),
        (dict(orthogonalization_epsilon=-1e-8), "orthogonalization_epsilon must be a finite"),
        (dict(compression_stats_logging_frequency=2.5), "compression_stats_logging_frequency"),
        (dict(min_compression_rate=True), "min_compression_rate must be a number"),
        (dict(orthogonalization_epsilon=True), "orthogonalization_epsilon must be a finite"),
        (dict(min_compression_rate=float("nan")), "min_compression_rate"),
        (dict(random_seed=-3), "random_seed"),
        (dict(warm_start="yes"), "warm_start must be True or False"),
        (dict(single_round=True, warm_start=False), "single_round=True needs warm_start=True"),
    ],
)
def test_bad_options_raise_at_construction(options, match):
    with pytest.raises(ValueError, match=match):
        PowerSGDState(None, **options)


def test_options_accepted_as_pytorch_accepts_them():
    # PyTorch's state logs every step for a frequency of 0 or less, and takes numpy numbers.
    assert (
        PowerSGDState(None, compression_stats_logging_frequency=0).options()[
            "compression_stats_logging_frequency"
        ]
        == 1
    )
    state = PowerSGDState(
        None, min_compression_rate=np.float32(3), orthogonalization_epsilon=np.float64(1e-8)
    )
    assert type(state.min_compression_rate) is float and state.min_compression_rate == 3.0
    assert state.orthogonalization_epsilon == pytest.approx(1e-8)


def test_start_zero_and_one_are_allowed():
    # PyTorch forbids start_powerSGD_iter <= 1 with error feedback or warm start.
    assert PowerSGDState(None, start_powerSGD_iter=0).start_powerSGD_iter == 0
    assert PowerSGDState(None, start_powerSGD_iter=1).start_powerSGD_iter == 1


def test_wrong_state_type_is_named():
    with pytest.raises(TypeError, match="needs a commhooks.PowerSGDState"):
        powerSGD_hook(None, FakeBucket([torch.zeros(3)]))


def test_orthogonalize_handles_zero_columns():
    for rank in (2, 3):  # Gram-Schmidt and QR
        m = torch.randn(2, 10, rank, dtype=torch.float64)
        m[0, :, 0] = 0
        lowrank.orthogonalize_(m)
        assert torch.isfinite(m).all()
        gram = m.transpose(1, 2) @ m
        expected = torch.eye(rank, dtype=m.dtype).expand(2, rank, rank).clone()
        if rank <= 2:
            assert torch.equal(m[0, :, 0], torch.zeros(10, dtype=m.dtype))
            expected[0, 0, 0] = 0
        torch.testing.assert_close(gram, expected)
    half = torch.zeros(1, 6, 2, dtype=torch.float16)
    assert torch.equal(lowrank.orthogonalize_(half), torch.zeros_like(half))


class _CountOps(TorchDispatchMode):
    """Counts the operations dispatched, each a kernel launch on a GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_column_is_pytorchs_where_its_norm_is_ordinary_and_safe_elsewhere(dtype):
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(8, 16, 1, generator=gen).to(dtype)
    theirs = m.clone()
    torch_powersgd._orthogonalize(theirs)
    ours = lowrank.orthogonalize_(m.clone())
    if dtype == torch.float32:  # PyTorch's bits on ordinary columns (half: ours in float32)
        assert torch.equal(ours, theirs)
    tiny, huge = (1e-30, 1e30) if dtype == torch.float32 else (1e-6, 6e4)
    m[0] *= tiny  # squares underflow: PyTorch divides by 0
    m[1] = huge  # squares overflow
    m[2] = 0  # stays zero, with and without epsilon
    m[3, 5], m[4, 7] = float("inf"), float("nan")
    for eps in (0.0, 1e-8):
        out = lowrank.orthogonalize_(m.clone(), epsilon=eps).double()
        norms = out[:2].norm(dim=1) if eps == 0 else out[1].norm(dim=0)  # eps outweighs tiny
        torch.testing.assert_close(norms, torch.ones_like(norms), atol=1e-3, rtol=0)
        assert torch.equal(out[2], torch.zeros_like(out[2]))
        assert not torch.isfinite(out[3]).all() and not torch.isfinite(out[4]).all()
        assert torch.equal(out[5:], lowrank.orthogonalize_(m[5:].clone(), epsilon=eps).double())
    # Where denormals are flushed to zero a zero column still comes back zero, not 0/0.
    if torch.set_flush_denormal(True):
        try:
            zero = lowrank.orthogonalize_(torch.zeros(2, 16, 2, dtype=dtype))
        finally:
            torch.set_flush_denormal(False)
        assert torch.equal(zero, torch.zeros_like(zero))
    counted, stack = _CountOps(), m.clone()
    with counted:
        lowrank.orthogonalize_(stack)
    # A safe norm at seven launches a column (it took fourteen); half precision adds its casts.
    assert counted.count <= (9 if dtype == torch.float32 else 11), counted.count
    counted, two = _CountOps(), torch.randn(8, 16, 2, generator=gen).to(dtype)
    with counted:  # and the collapse test's column norms at two (they took eight)
        lowrank.orthogonalize_(two)
    assert counted.count <= (53 if dtype == torch.float32 else 55), counted.count


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_orthogonalize_with_qr_at_any_rank_and_precision(dtype):
    # What the single-round variant uses: the same subspace, orthonormal, never NaN.
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(3, 12, 2, generator=gen, dtype=torch.float64)
    m[1, :, 1] = 0  # a zero column becomes a unit vector orthogonal to the other
    m[2] = 0
    m = m.to(dtype)
    before = m.double()
    q = lowrank.orthogonalize_(m, method="qr").double()
    assert torch.isfinite(q).all()
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    eye = torch.eye(2, dtype=torch.float64).expand(3, 2, 2)
    torch.testing.assert_close(q.transpose(1, 2) @ q, eye, atol=tol, rtol=0)
    projected = q[:2] @ (q[:2].transpose(1, 2) @ before[:2])  # the columns' span is kept
    torch.testing.assert_close(projected, before[:2], atol=tol * 10, rtol=0)
    with pytest.raises(ValueError, match="'auto' or 'qr'"):
        lowrank.orthogonalize_(m, method="svd")
