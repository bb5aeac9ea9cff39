"""PowerSGD hooks against PyTorch's (the oracle) and where PyTorch's break, gloo, 2-3 ranks."""

import logging
import math
import warnings

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
from commhooks import PowerSGDState, batched_powerSGD_hook, powerSGD_hook
from commhooks.compress import lowrank
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
    out = []
    for options in CONFIGS:
        # Rank 1 in float32, bit for bit. At higher ranks the products run with the factors'
        # columns contiguous (faster on a CPU), which rounds otherwise; warm start and error
        # feedback carry that rounding from step to step, so float64 is where the two are
        # compared: a difference in the algorithm still shows, rounding no longer does.
        dtype = torch.float32 if options["matrix_approximation_rank"] == 1 else torch.float64
        data = [(x.to(dtype), y.to(dtype)) for x, y in batches(rank, steps)]
        ours = PowerSGDState(None, start_powerSGD_iter=2, **options)
        theirs = torch_powersgd.PowerSGDState(None, start_powerSGD_iter=2, **options)
        widths = SAME_SHAPES if options.get("batch_tensors_with_same_shape") else None
        model = make_mlp(widths=widths) if widths else make_mlp()
        a = _grads_per_step(make_ddp(model.to(dtype), powerSGD_hook, ours, ONE_BUCKET), data)
        model = make_mlp(widths=widths) if widths else make_mlp()
        hook = torch_powersgd.powerSGD_hook
        b = _grads_per_step(make_ddp(model.to(dtype), hook, theirs, ONE_BUCKET), data)
        out.append((a, b, ours.compression_stats(), theirs.compression_stats()))
    return out


def test_same_numerics_as_pytorch_on_one_bucket():
    for per_rank in run_on_ranks(_against_pytorch, 2, 20):
        for options, (ours, theirs, our_stats, their_stats) in zip(CONFIGS, per_rank):
            if options["matrix_approximation_rank"] == 1:
                assert torch.equal(ours, theirs), options
            relative = (ours - theirs).norm(dim=1) / theirs.norm(dim=1)
            assert float(relative.max()) <= 1e-9, (options, relative)
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


def _count_collectives(rank, world_size, single_round, steps):
    data = batches(rank, steps)
    state = PowerSGDState(None, start_powerSGD_iter=0, single_round=single_round)
    hook, seen = count_buckets(powerSGD_hook)
    ddp = make_ddp(make_mlp(), hook, state, bucket_cap_mb=0.004)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.02)
    x, y = data[0]
    torch.nn.functional.mse_loss(ddp(x), y).backward()  # step 1: DDP's initial single bucket
    opt.step()
    counted_before = state.compression_stats()[2]
    with commhooks.comm.observe_collectives() as counter:
        for x, y in data[1:]:
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
    stats = state.compression_stats()[2] - counted_before
    calls, numel = sum(counter.calls.values()), sum(counter.bytes.values()) // 4
    return calls, len(seen), numel, sum(p.numel() for p in ddp.parameters()), stats


def _count_both(rank, world_size, steps):
    return [_count_collectives(rank, world_size, single, steps) for single in (True, False)]


def test_single_round_sends_one_collective_per_bucket():
    steps = 5
    single, double = run_on_ranks(_count_both, 2, steps)[0]
    one, buckets, one_numel, total, one_stats = single
    two, _, two_numel, _, two_stats = double
    assert one == buckets * (steps - 1)
    assert two == 2 * buckets * (steps - 1)  # P (the vectors with it) and Q per bucket
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
        "non-finite": [
            _non_finite(rank, world_size, single, policy)
            for single in (False, True)
            for policy in ("propagate", "repair")
        ],
        "non-finite-several": [
            _non_finite(rank, world_size, single, "propagate", SEVERAL, BAD_IN_THE_SECOND)
            for single in (False, True)
        ],
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


def _non_finite(
    rank, world_size, single_round, policy, shapes=((16, 12), (12,)), bad=3, device="cpu"
):
    """A step whose gradient holds inf on rank 0, after a finite one: the result, and whether
    the memory and the factors are exactly what the finite step left."""
    gen = torch.Generator().manual_seed(rank)
    tensors = [torch.randn(shape, generator=gen) for shape in shapes]
    bucket = FakeBucket(tensors, device=device)
    state = PowerSGDState(
        None, start_powerSGD_iter=0, single_round=single_round, on_nonfinite=policy
    )
    powerSGD_hook(state, bucket).wait()
    saved = {k: v.clone() for k, v in state.error_dict.items()}
    factors = {k: v.clone() for k, v in [*state.q_memory_dict.items()]}
    p_factors = {k: v.clone() for k, v in state.p_memory_dict.items()}
    local = torch.randn(bucket.buffer().shape, generator=gen)
    if rank == 0:
        local[bad] = float("inf")
    bucket.buffer().copy_(local)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = powerSGD_hook(state, bucket).wait().cpu()
    kept = (
        saved.keys() == state.error_dict.keys()
        and all(torch.equal(saved[k], state.error_dict[k]) for k in saved)
        and all(torch.equal(factors[k], state.q_memory_dict[k]) for k in factors)
        and all(torch.equal(p_factors[k], state.p_memory_dict[k]) for k in p_factors)
    )
    everyone = local.clone()
    dist.all_reduce(everyone)
    return out, kept, everyone / world_size, len(caught)


# Three matrices, the inf in the second.
SEVERAL = ((16, 12), (12,), (20, 6), (10, 10))
BAD_IN_THE_SECOND = 16 * 12 + 12 + 5


def test_a_non_finite_step_leaves_memory_and_factors_exactly_as_they_were(fake_bucket_results):
    for per_rank in fake_bucket_results:
        for out, kept, _, _ in per_rank["non-finite"] + per_rank["non-finite-several"]:
            assert kept and not torch.isfinite(out).all()


def test_the_repair_sends_a_non_finite_bucket_again_as_plain_allreduce(fake_bucket_results):
    for per_rank in fake_bucket_results:
        for single in (0, 1):
            propagated, _, _, quiet = per_rank["non-finite"][2 * single]
            repaired, _, plain, warned = per_rank["non-finite"][2 * single + 1]
            # Warned once a process for the hook and bucket: at the first repair (two rounds).
            assert quiet == 0 and warned == (1 - single)
            assert torch.isinf(repaired[3]) and torch.equal(repaired, plain)
            assert not torch.equal(propagated.isfinite(), plain.isfinite())  # NaN spreads


def test_a_layer_learns_again_after_a_zero_gradient(fake_bucket_results):
    # With warm start, a zero Q would stay zero (M·0 = 0): the layer would get zeros forever.
    for per_rank in fake_bucket_results:
        for sizes in per_rank["zero-then-learn"]:
            assert sizes[0] == 0.0
            assert all(math.isfinite(x) and x > 0 for x in sizes[1:]), sizes


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
