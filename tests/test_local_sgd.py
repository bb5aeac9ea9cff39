"""post_localSGD_hook: warm-up, local phase, per-machine subgroups on CPU, configuration."""

import os

import pytest
import torch
from ddp_utils import FakeBucket, batches, flat_params, make_ddp, make_mlp, train
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as torch_local

import commhooks
from commhooks import comm
from commhooks.comm.topology import MACHINE_ID_VAR, LaunchInfo, machine_rank_lists
from commhooks.testing import run_on_ranks

STEPS = 6


def _warmup_vs_plain(rank, world_size):
    data = batches(rank, STEPS)
    state = commhooks.PostLocalSGDState(None, None, start_localSGD_iter=100)
    ours = make_ddp(make_mlp(), commhooks.post_localSGD_hook, state)
    plain = make_ddp(make_mlp())
    train(ours, data)
    train(plain, data)
    return flat_params(ours.module), flat_params(plain.module), state.iter, state.subgroup


def test_warmup_is_bitwise_plain_ddp_and_iter_counts_steps():
    for ours, plain, steps, subgroup in run_on_ranks(_warmup_vs_plain, 2):
        assert torch.equal(ours, plain)
        assert steps == STEPS
        assert subgroup is None  # no group is created while warming up


def _across_start_vs_reference(rank, world_size):
    """Ours and PyTorch's hook, warm-up then no gradient communication, same data."""
    data = batches(rank, STEPS)
    state = commhooks.PostLocalSGDState(None, None, 3, post_local_gradient_allreduce=False)
    ref_state = torch_local.PostLocalSGDState(None, None, 3, post_local_gradient_allreduce=False)
    ours = make_ddp(make_mlp(), commhooks.post_localSGD_hook, state)
    ref = make_ddp(make_mlp(), torch_local.post_localSGD_hook, ref_state)
    train(ours, data)
    train(ref, data)
    return flat_params(ours.module), flat_params(ref.module)


def test_matches_pytorch_hook_across_the_start_of_local_sgd():
    (a0, r0), (a1, r1) = run_on_ranks(_across_start_vs_reference, 2)
    assert torch.equal(a0, r0) and torch.equal(a1, r1)
    assert not torch.equal(a0, a1), "ranks trained locally on different data: must differ"


def _diverge_and_average(rank, world_size, start, period, steps):
    data = batches(rank, steps)
    state = commhooks.PostLocalSGDState(None, None, start, post_local_gradient_allreduce=False)
    ddp = make_ddp(make_mlp(), commhooks.post_localSGD_hook, state)
    opt = commhooks.PostLocalSGDOptimizer(
        torch.optim.SGD(ddp.parameters(), lr=0.05),
        commhooks.PeriodicModelAverager(period, warmup_steps=start),
    )
    after_each_step = []
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        after_each_step.append(flat_params(ddp.module))
    return after_each_step, state.subgroup


def test_parameters_diverge_between_averagings_and_agree_right_after():
    start, period, steps = 2, 3, 10
    (p0, sub0), (p1, _) = run_on_ranks(_diverge_and_average, 2, start, period, steps)
    assert sub0 is None, "post_local_gradient_allreduce=False must not create subgroups"
    for step in range(steps):
        averaged = step >= start and (step - start) % period == 0
        if step < start or averaged:
            torch.testing.assert_close(p0[step], p1[step], rtol=0, atol=1e-6)
        else:
            assert (p0[step] - p1[step]).abs().max() > 1e-4, f"step {step} did not diverge"


def _subgroup_probe(rank, world_size, relabel):
    if relabel:
        os.environ[MACHINE_ID_VAR] = f"box{rank % 2}"
    state = commhooks.PostLocalSGDState(None, None, start_localSGD_iter=0)
    grad = torch.full((5,), float(rank))
    averaged = commhooks.post_localSGD_hook(state, FakeBucket([grad])).wait()
    return comm.global_ranks(state.subgroup), state.subgroup_source, averaged


def test_default_subgroup_is_one_per_machine_on_cpu():
    # One machine (the harness sets LOCAL_WORLD_SIZE to the world size): the whole world.
    for ranks, source, averaged in run_on_ranks(_subgroup_probe, 2, False):
        assert ranks == [0, 1] and "host names" in source
        assert torch.equal(averaged, torch.full((5,), 0.5))


def _two_machines_per_host(rank, world_size):
    by_local_world_size = _subgroup_probe(rank, world_size, False)
    by_label = _subgroup_probe(rank, world_size, True)
    return by_local_world_size, by_label


def test_local_world_size_and_machine_id_split_one_host_into_machines():
    results = run_on_ranks(_two_machines_per_host, 4, env={"LOCAL_WORLD_SIZE": "2"})
    for rank, (by_size, by_label) in enumerate(results):
        ranks, source, averaged = by_size
        assert ranks == ([0, 1] if rank < 2 else [2, 3])
        assert "LOCAL_WORLD_SIZE" in source
        assert torch.equal(averaged, torch.full((5,), 0.5 if rank < 2 else 2.5))
        # COMMHOOKS_MACHINE_ID overrides host names and LOCAL_WORLD_SIZE.
        ranks, source, averaged = by_label
        assert ranks == ([0, 2] if rank % 2 == 0 else [1, 3])
        assert MACHINE_ID_VAR in source
        assert torch.equal(averaged, torch.full((5,), 1.0 if rank % 2 == 0 else 2.0))


def test_single_rank_machines_skip_gradient_communication():
    results = run_on_ranks(_subgroup_probe, 2, False, env={"LOCAL_WORLD_SIZE": "1"})
    for rank, (ranks, _, averaged) in enumerate(results):
        assert ranks == [rank]
        assert torch.equal(averaged, torch.full((5,), float(rank)))


def test_machine_membership_rules():
    info = LaunchInfo
    lists, _ = machine_rank_lists([info("a", None, 3)] * 6)
    assert lists == [[0, 1, 2], [3, 4, 5]]
    lists, source = machine_rank_lists([info("a", None, None), info("b", None, None)] * 2)
    assert lists == [[0, 2], [1, 3]] and source.startswith("host names:")
    lists, _ = machine_rank_lists([info("a", None, 4)] * 6)  # does not tile: one machine
    assert lists == [[0, 1, 2, 3, 4, 5]]
    lists, source = machine_rank_lists([info("a", "x", 2), info("a", None, 2)])
    assert lists == [[0, 1]] and "ignored" in source


def _registered(rank, world_size):
    ddp = make_ddp(make_mlp())
    state = commhooks.register(
        ddp,
        "post_local_sgd",
        wrapper="fp16",
        start_localSGD_iter=2,
        post_local_gradient_allreduce=False,
    )
    train(ddp, batches(rank, 4))
    return type(state).__name__, state.iter, flat_params(ddp.module)


def test_register_by_name_with_an_fp16_wrapper():
    (name, steps, p0), (_, _, p1) = run_on_ranks(_registered, 2)
    assert name == "PostLocalSGDState" and steps == 4
    assert not torch.equal(p0, p1)


def test_register_needs_start_and_rejects_unknown_options():
    with pytest.raises(ValueError, match="start_localSGD_iter"):
        commhooks.register(object(), "post_local_sgd")
    with pytest.raises(ValueError, match="period"):
        commhooks.register(object(), "post_local_sgd", start_localSGD_iter=1, period=4)


def test_bad_state_options():
    with pytest.raises(ValueError, match="start_localSGD_iter must be >= 0"):
        commhooks.PostLocalSGDState(None, None, -1)
    with pytest.raises(ValueError, match="integer"):
        commhooks.PostLocalSGDState(None, None, 2.5)
    with pytest.raises(ValueError, match="True or False"):
        commhooks.PostLocalSGDState(None, None, 1, post_local_gradient_allreduce="no")
    with pytest.raises(TypeError, match="subgroup"):
        commhooks.PostLocalSGDState(None, [0, 1], 1)
    with pytest.raises(TypeError, match="PostLocalSGDState"):
        commhooks.post_localSGD_hook(None, FakeBucket([torch.zeros(2)]))


def _custom_groups(rank, world_size):
    import torch.distributed as dist

    everyone = dist.new_group([0, 1])
    only_first = dist.new_group([0])
    state = commhooks.PostLocalSGDState(everyone, None, start_localSGD_iter=1)
    bucket = FakeBucket([torch.full((3,), float(rank))])
    outs = [commhooks.post_localSGD_hook(state, bucket).wait().clone() for _ in range(2)]
    refused = kept = None
    if rank == 0:
        try:
            commhooks.PostLocalSGDState(only_first, None, 1)
        except ValueError as exc:
            refused = str(exc)
        quiet = commhooks.PostLocalSGDState(
            only_first, None, 1, post_local_gradient_allreduce=False
        )
        kept = quiet.process_group is only_first
    return outs, state.subgroup_source, refused, kept


def test_per_machine_subgroups_with_a_group_of_every_rank():
    (outs, source, refused, kept), _ = run_on_ranks(_custom_groups, 2)
    assert torch.equal(outs[0], torch.full((3,), 0.5))  # warm-up: averaged over both ranks
    assert source and source.startswith("one subgroup per machine")
    assert refused and "pass subgroup= explicitly" in refused
    assert kept  # no gradient averaging after the warm-up: no subgroup needed


def _mismatched(rank, world_size):
    state = commhooks.PostLocalSGDState(None, None, start_localSGD_iter=rank)
    commhooks.post_localSGD_hook(state, FakeBucket([torch.zeros(3)])).wait()


def test_ranks_configured_differently_get_a_readable_error():
    with pytest.raises(Exception, match="start_localSGD_iter: rank 0=0, rank 1=1"):
        run_on_ranks(_mismatched, 2)
