"""The default hooks against plain DDP and PyTorch's own hooks, on gloo with 2 ranks."""

import os
import signal

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
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_default

import commhooks
from commhooks.testing import RankError, run_on_ranks

STEPS = 6


def _train_pair(rank, world_size, ours, theirs, ours_state=None, theirs_state=None):
    """Train two identical models, one per hook, on the same per-rank data."""
    data = batches(rank, STEPS)
    hook, seen = count_buckets(ours)
    a = make_ddp(make_mlp(), hook, ours_state)
    b = make_ddp(make_mlp(), theirs, theirs_state)
    train(a, data)
    train(b, data)
    return flat_params(a.module), flat_params(b.module), len(seen)


def test_allreduce_hook_is_bitwise_plain_ddp():
    for ours, plain, buckets in run_on_ranks(_train_pair, 2, commhooks.allreduce_hook, None):
        assert buckets >= 3
        assert torch.equal(ours, plain)


def test_allreduce_hook_is_bitwise_plain_ddp_on_three_ranks():
    for ours, plain, _ in run_on_ranks(_train_pair, 3, commhooks.allreduce_hook, None):
        assert torch.equal(ours, plain)


def test_fp16_compress_hook_is_bitwise_pytorch():
    results = run_on_ranks(
        _train_pair, 2, commhooks.fp16_compress_hook, torch_default.fp16_compress_hook
    )
    for ours, theirs, buckets in results:
        assert buckets >= 3
        assert torch.equal(ours, theirs)
    assert not torch.equal(results[0][0], flat_params(make_mlp())), "training changed nothing"


def test_fp16_wrapper_around_allreduce_equals_fp16_hook():
    wrapped = commhooks.fp16_compress_wrapper(commhooks.allreduce_hook)
    for ours, theirs, _ in run_on_ranks(_train_pair, 2, wrapped, commhooks.fp16_compress_hook):
        assert torch.equal(ours, theirs)


def _bf16_step(rank, world_size, hook):
    torch.manual_seed(rank)
    local = torch.randn(1000) * 10.0 ** torch.randint(-6, 3, (1000,))
    ours = hook(None, FakeBucket([local.clone()])).wait()
    # The reference computation: divide, cast to bf16, sum across ranks, cast back.
    everyone = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(everyone, local)
    expected = torch.zeros(local.numel(), dtype=torch.bfloat16)
    for g in everyone:
        expected += (g / world_size).to(torch.bfloat16)
    return ours, expected.to(local.dtype)


@pytest.mark.parametrize(
    "hook",
    [commhooks.bf16_compress_hook, commhooks.bf16_compress_wrapper(commhooks.allreduce_hook)],
    ids=["hook", "wrapper"],
)
def test_bf16_matches_reference_computation(hook):
    for ours, expected in run_on_ranks(_bf16_step, 2, hook):
        assert torch.equal(ours, expected)


def test_bf16_compress_hook_is_accepted_by_ddp_on_cpu():
    # PyTorch's own bf16 hook is refused on CPU by name; ours trains.
    for ours, plain, _ in run_on_ranks(_train_pair, 2, commhooks.bf16_compress_hook, None):
        assert torch.allclose(ours, plain, rtol=1e-2, atol=1e-3)


def _reference_bf16_refused(rank, world_size):
    ddp = make_ddp(make_mlp())
    with pytest.raises(TypeError, match="BF16"):
        ddp.register_comm_hook(None, torch_default.bf16_compress_hook)
    ddp.register_comm_hook(None, commhooks.bf16_compress_wrapper(commhooks.allreduce_hook))
    return True


def test_reference_bf16_refused_on_cpu_but_ours_accepted():
    assert all(run_on_ranks(_reference_bf16_refused, 2))


def _noop(rank, world_size):
    model = make_mlp()
    x, y = batches(rank, 1)[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    local = flat_grads(model)
    ddp = make_ddp(make_mlp(), commhooks.noop_hook)
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    # Called directly with an explicit group, it hands back the very same buffer.
    bucket = FakeBucket([local.clone()])
    direct = commhooks.noop_hook(dist.group.WORLD, bucket).wait()
    assert direct is bucket.buffer()
    return local, flat_grads(ddp.module), direct


def test_noop_hook_keeps_local_gradient():
    (l0, g0, d0), (l1, g1, d1) = run_on_ranks(_noop, 2)
    assert torch.equal(l0, g0) and torch.equal(l1, g1)
    assert torch.equal(l0, d0) and torch.equal(l1, d1)
    assert not torch.equal(g0, g1)


def _wrapped_stateless(rank, world_size, wrapper_name):
    wrapper = getattr(commhooks, wrapper_name)
    for inner in (commhooks.allreduce_hook, commhooks.fp16_compress_hook):
        ddp = make_ddp(make_mlp(), wrapper(inner))
        train(ddp, batches(rank, 3))
    return flat_params(ddp.module)


@pytest.mark.parametrize("wrapper", ["fp16_compress_wrapper", "bf16_compress_wrapper"])
def test_wrappers_compose_with_stateless_hooks(wrapper):
    a, b = run_on_ranks(_wrapped_stateless, 2, wrapper)
    assert torch.equal(a, b)


def test_warnings_are_filterable_as_ours_as_user_and_as_runtime_warnings():
    assert issubclass(commhooks.CommHooksWarning, UserWarning)
    assert issubclass(commhooks.CommHooksWarning, RuntimeWarning)
    with pytest.warns(UserWarning, match="restored warmup_steps=1"):
        commhooks.PeriodicModelAverager(2).load_state_dict(
            commhooks.PeriodicModelAverager(2, warmup_steps=1).state_dict()
        )


def _bad_inputs(rank, world_size):
    hooks = [
        commhooks.allreduce_hook,
        commhooks.fp16_compress_hook,
        commhooks.bf16_compress_hook,
        commhooks.noop_hook,
        commhooks.fp16_compress_wrapper(commhooks.allreduce_hook),
        commhooks.bf16_compress_wrapper(commhooks.noop_hook),
    ]
    messages = []
    for hook in hooks:
        with pytest.raises(TypeError, match="ProcessGroup or None") as err:
            hook(object(), FakeBucket([torch.ones(3)]))
        messages.append(str(err.value))
        with pytest.raises(TypeError, match="floating point") as err:
            hook(None, FakeBucket([torch.ones(3, dtype=torch.int64)]))
        messages.append(str(err.value))
    only_rank0 = dist.new_group([0])
    if rank == 1:
        for hook in hooks:
            with pytest.raises(ValueError, match="not a member"):
                hook(only_rank0, FakeBucket([torch.ones(3)]))
    # No stray collective was issued above: the next one still pairs up correctly.
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item(), messages


def test_bad_input_raises_before_any_collective():
    for total, messages in run_on_ranks(_bad_inputs, 2):
        assert total == 3.0
        assert all(m for m in messages)


def _fails(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank one")
    return rank


def test_harness_surfaces_failing_rank_traceback():
    with pytest.raises(RankError, match="(?s)rank 1 raised.*boom from rank one"):
        run_on_ranks(_fails, 2, timeout=60)


def _crashes(rank, world_size):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)  # as a crash in native code would
    dist.barrier()  # rank 0 finds its peer gone and raises
    return rank


def test_harness_shows_the_stacks_of_a_rank_that_crashed():
    with pytest.raises(RankError, match="(?s)rank 1.*Segmentation fault.*in _crashes"):
        run_on_ranks(_crashes, 2, timeout=60, pg_timeout=10)


def _hangs(rank, world_size):
    if rank == 0:
        dist.barrier()
    return rank


def test_harness_reports_a_hang_as_a_failure():
    with pytest.raises(RankError):
        run_on_ranks(_hangs, 2, timeout=20, pg_timeout=5)
