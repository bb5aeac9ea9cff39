"""Checkpointing post-local SGD and the averagers: exact resume, safe loading, pickling."""

import io
import os
import pickle

import pytest
import torch
import torch.distributed as dist
from ddp_utils import batches, flat_params, make_ddp, make_mlp

import commhooks
from commhooks.state import StateDictError
from commhooks.testing import run_on_ranks

START, PERIOD, STEPS = 2, 4, 8  # averaging at steps 2, 6, 10, 14: saved mid-period


def _build(kind):
    state = commhooks.PostLocalSGDState(None, None, START, post_local_gradient_allreduce=False)
    ddp = make_ddp(make_mlp(), commhooks.post_localSGD_hook, state)
    if kind == "periodic":
        averager = commhooks.PeriodicModelAverager(PERIOD, warmup_steps=START)
    else:
        averager = commhooks.OuterOptimizerAverager(PERIOD, warmup_steps=START)
    inner = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    return ddp, state, commhooks.PostLocalSGDOptimizer(inner, averager)


def _steps(ddp, opt, data):
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()


def _resume(rank, world_size, kind, directory, phase, save_at):
    data = batches(rank, 2 * STEPS)
    path = os.path.join(directory, f"rank{rank}.pt")
    ddp, state, opt = _build(kind)
    if phase == "uninterrupted":
        _steps(ddp, opt, data[:save_at])
        checkpoint = {
            "model": ddp.module.state_dict(),
            "optimizer": opt.state_dict(),
            "hook": state.state_dict(),
        }
        torch.save(checkpoint, path)
        _steps(ddp, opt, data[save_at:])
        return flat_params(ddp.module)
    checkpoint = torch.load(path, weights_only=True)
    # After DDP is built: it broadcasts rank 0's parameters, and between averagings the ranks'
    # parameters differ.
    ddp.module.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])
    state.load_state_dict(checkpoint["hook"])
    _steps(ddp, opt, data[save_at:])
    return flat_params(ddp.module), state.iter, opt.averager.step, checkpoint["optimizer"]


# ("outer", START): saved after the warm-up snapshot and before the first sync, which steps
# from that snapshot; resuming without it would start with a plain average instead.
@pytest.mark.parametrize(
    ("kind", "save_at"), [("periodic", STEPS), ("outer", STEPS), ("outer", START)]
)
def test_exact_resume_in_fresh_processes(kind, save_at, tmp_path):
    full = run_on_ranks(_resume, 2, kind, str(tmp_path), "uninterrupted", save_at)
    resumed = run_on_ranks(_resume, 2, kind, str(tmp_path), "resume", save_at)
    for uninterrupted, (params, steps, averager_step, saved) in zip(full, resumed):
        assert torch.equal(params, uninterrupted)
        assert steps == averager_step == 2 * STEPS
        assert saved["averager"]["step"] == save_at
        assert saved["averager"].get("synced", True), "the snapshot must have been saved"
    assert not torch.equal(full[0], full[1]), "the run must end between averagings"


def _averaging_gradients(rank, world_size, directory, phase, start, save_at):
    """post-local SGD averaging gradients (within its subgroup after ``start``: here every rank,
    one machine), saved after ``save_at`` of 6 steps; ``phase`` the uninterrupted run or the
    resume from its files. The parameters after."""
    data, path = batches(rank, 6), os.path.join(directory, f"rank{rank}.pt")
    state = commhooks.PostLocalSGDState(None, None, start)
    ddp = make_ddp(make_mlp(), commhooks.post_localSGD_hook, state)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    if phase == "resume":
        saved = torch.load(path, weights_only=True)
        ddp.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        state.load_state_dict(saved["hook"])
    else:
        _steps(ddp, opt, data[:save_at])
        saved = {"model": ddp.module.state_dict(), "optimizer": opt.state_dict()}
        torch.save({**saved, "hook": state.state_dict()}, path)
    _steps(ddp, opt, data[save_at:])
    return flat_params(ddp.module)


@pytest.mark.parametrize(("start", "save_at"), [(4, 2), (2, 4)], ids=["warm-up", "local"])
def test_exact_resume_of_gradient_averages_on_four_ranks(start, save_at, tmp_path):
    # Gloo's ring sums an element in an order that depends on where it lies in the buffer, and
    # a fresh DDP's first bucket holds every parameter: it is cut as the saved run's were.
    args = str(tmp_path), start, save_at
    full = run_on_ranks(_averaging_gradients, 4, args[0], "uninterrupted", *args[1:])
    resumed = run_on_ranks(_averaging_gradients, 4, args[0], "resume", *args[1:])
    for uninterrupted, params in zip(full, resumed):
        assert torch.equal(params, uninterrupted)


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _trained_objects():
    p = torch.nn.Parameter(torch.ones(3))
    inner = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(3)
    inner.step()
    state = commhooks.PostLocalSGDState(None, None, 5)
    state.iter = 7
    periodic = commhooks.PeriodicModelAverager(3)
    periodic.step = 4
    wrapper = commhooks.PostLocalSGDOptimizer(inner, commhooks.PeriodicModelAverager(2))
    wrapper.averager.step = 9
    return state, periodic, wrapper


def test_state_dicts_load_with_weights_only_and_restore():
    state, periodic, wrapper = _trained_objects()
    fresh_state = commhooks.PostLocalSGDState(None, None, 5)
    fresh_state.load_state_dict(_roundtrip(state))
    assert fresh_state.iter == 7
    fresh_periodic = commhooks.PeriodicModelAverager(3)
    fresh_periodic.load_state_dict(_roundtrip(periodic))
    assert fresh_periodic.step == 4
    q = torch.nn.Parameter(torch.ones(3))
    fresh = commhooks.PostLocalSGDOptimizer(
        torch.optim.SGD([q], lr=0.1, momentum=0.9), commhooks.PeriodicModelAverager(2)
    )
    fresh.load_state_dict(_roundtrip(wrapper))
    assert fresh.averager.step == 9
    assert torch.equal(fresh.state[q]["momentum_buffer"], torch.ones(3))


def test_wrapper_state_dict_is_compatible_with_pytorch_post_local_sgd_optimizer():
    from torch.distributed.algorithms.model_averaging.averagers import (
        PeriodicModelAverager as TorchPeriodic,
    )
    from torch.distributed.optim import PostLocalSGDOptimizer as TorchWrapper

    _, _, wrapper = _trained_objects()
    ours = wrapper.state_dict()
    assert ours["step"] == 9 and "param_groups" in ours and "state" in ours
    # PyTorch's wrapper reads ours...
    q = torch.nn.Parameter(torch.ones(3))
    theirs = TorchWrapper(torch.optim.SGD([q], lr=0.1, momentum=0.9), object.__new__(TorchPeriodic))
    theirs.load_state_dict(ours)
    assert theirs.averager.step == 9
    assert torch.equal(theirs.optim.state[q]["momentum_buffer"], torch.ones(3))
    # ...and ours reads PyTorch's (the inner optimizer's dict plus "step").
    wrapper.load_state_dict({**wrapper.optim.state_dict(), "step": 12})
    assert wrapper.averager.step == 12


def test_state_dict_of_another_kind_is_rejected_and_changes_nothing():
    state, periodic, wrapper = _trained_objects()
    with pytest.raises(
        StateDictError, match="'periodic_model_averager' state, not 'post_local_sgd'"
    ):
        state.load_state_dict(periodic.state_dict())
    assert state.iter == 7
    with pytest.raises(StateDictError, match="not a commhooks state dict"):
        periodic.load_state_dict(make_mlp().state_dict())
    assert periodic.step == 4
    with pytest.raises(StateDictError, match="'step' must be a non-negative integer"):
        periodic.load_state_dict({"kind": "periodic_model_averager", "version": 1, "step": -3})
    assert periodic.step == 4

    before = wrapper.optim.state_dict()
    bad_averager = {**wrapper.state_dict(), "averager": state.state_dict()}
    bad_averager["param_groups"][0]["lr"] = 123.0
    with pytest.raises(
        StateDictError, match="'post_local_sgd' state, not 'periodic_model_averager'"
    ):
        wrapper.load_state_dict(bad_averager)
    assert wrapper.optim.state_dict()["param_groups"] == before["param_groups"]

    two_params = [torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(2))]
    other = torch.optim.SGD(two_params, lr=0.1)
    foreign_inner = {**wrapper.state_dict(), **other.state_dict()}
    foreign_inner["averager"]["step"] = 50
    with pytest.raises(StateDictError, match="inner optimizer"):
        wrapper.load_state_dict(foreign_inner)
    assert wrapper.averager.step == 9


def test_averagers_refuse_another_period_and_restore_the_warmup():
    saved = commhooks.PeriodicModelAverager(3, warmup_steps=2)
    saved.step = 6
    sd = _roundtrip(saved)
    assert (sd["period"], sd["warmup_steps"]) == (3, 2)
    other_period = commhooks.PeriodicModelAverager(4, warmup_steps=2)
    with pytest.raises(StateDictError, match="period=3, but this one has period=4"):
        other_period.load_state_dict(sd)
    assert other_period.step == 0
    # The warm-up is part of the saved schedule: restored, with a warning when it differs.
    other_warmup = commhooks.OuterOptimizerAverager(3, warmup_steps=5)
    outer_sd = {**sd, "kind": "outer_optimizer_averager", "synced": False, "snapshot": []}
    with pytest.warns(UserWarning, match="restored warmup_steps=2 .* built with warmup_steps=5"):
        other_warmup.load_state_dict(outer_sd)
    assert (other_warmup.step, other_warmup.warmup_steps) == (6, 2)
    plain = commhooks.PeriodicModelAverager(3)
    with pytest.warns(UserWarning, match="restored warmup_steps=2"):
        plain.load_state_dict(sd)
    assert (plain.step, plain.warmup_steps) == (6, 2)
    with pytest.raises(StateDictError, match="'warmup_steps' must be a non-negative integer"):
        commhooks.PeriodicModelAverager(3).load_state_dict({**sd, "warmup_steps": -1})

    inner = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    wrapper = commhooks.PostLocalSGDOptimizer(inner, commhooks.PeriodicModelAverager(3))
    wrapper_sd = _roundtrip(wrapper)
    wrapper_sd["averager"]["period"] = 4
    wrapper_sd["param_groups"][0]["lr"] = 123.0
    with pytest.raises(StateDictError, match="period=4, but this one has period=3"):
        commhooks.PostLocalSGDOptimizer(inner, saved).load_state_dict(wrapper_sd)
    assert inner.param_groups[0]["lr"] == 0.1 and saved.step == 6

    # State dicts from before the schedule was saved still load.
    fresh = commhooks.PeriodicModelAverager(4, warmup_steps=7)
    fresh.load_state_dict({"kind": "periodic_model_averager", "version": 1, "step": 5})
    assert fresh.step == 5


def _hierarchy_mismatch(rank, world_size):
    saved = commhooks.HierarchicalModelAverager({1: 1, 2: 2})
    saved.step = 3
    sd = _roundtrip(saved)
    other = commhooks.HierarchicalModelAverager({1: 1, 4: 2})
    try:
        other.load_state_dict(sd)
        message = ""
    except StateDictError as exc:
        message = str(exc)
    same = commhooks.HierarchicalModelAverager({1: 1, 2: 2})
    same.load_state_dict(sd)
    return sd["period_group_sizes"], message, other.step, same.step


def test_hierarchical_averager_refuses_a_state_dict_of_another_hierarchy():
    for levels, message, other_step, same_step in run_on_ranks(_hierarchy_mismatch, 2):
        assert levels == [[1, 1], [2, 2]]
        assert "period_group_size_dict={1: 1, 2: 2}" in message
        assert "this one has period_group_size_dict={1: 1, 4: 2}" in message
        assert other_step == 0 and same_step == 3


def test_outer_averager_rejects_a_malformed_snapshot_and_changes_nothing():
    averager = commhooks.OuterOptimizerAverager(2)
    good = averager.state_dict()
    with pytest.raises(StateDictError, match="snapshot"):
        averager.load_state_dict({**good, "step": 3, "synced": True, "snapshot": ["x"]})
    with pytest.raises(StateDictError, match="outer optimizer"):
        averager.load_state_dict(
            {**good, "step": 3, "synced": True, "snapshot": [torch.ones(2)], "outer_optimizer": {}}
        )
    assert averager.step == 0 and averager.snapshot is None


def test_pickling_drops_the_group_and_keeps_counters():
    state, periodic, wrapper = _trained_objects()
    copy = pickle.loads(pickle.dumps(state))
    assert copy.iter == 7 and copy.process_group is None and copy.subgroup is None
    assert pickle.loads(pickle.dumps(periodic)).step == 4
    assert pickle.loads(pickle.dumps(wrapper)).averager.step == 9
    outer = commhooks.OuterOptimizerAverager(2)
    assert pickle.loads(pickle.dumps(outer)).outer_optimizer_factory.keywords["nesterov"]


def _pickled_with_groups(rank, world_size):
    explicit = commhooks.PostLocalSGDState(None, dist.group.WORLD, 0)
    restored = pickle.loads(pickle.dumps(explicit))
    try:
        restored.ensure_subgroup()
        message = ""
    except RuntimeError as exc:
        message = str(exc)
    restored.bind(None, subgroup=dist.group.WORLD)
    rebound = restored.subgroup is dist.group.WORLD

    derived = commhooks.PostLocalSGDState(None, None, 0)
    derived.ensure_subgroup()
    derived = pickle.loads(pickle.dumps(derived))
    rederived = derived.subgroup is None and derived.ensure_subgroup() is not None

    hierarchical = commhooks.HierarchicalModelAverager({1: 1, 2: 2})
    hierarchical.step = 2
    hierarchical = pickle.loads(pickle.dumps(hierarchical))
    p = torch.nn.Parameter(torch.full((2,), float(rank)))
    p.grad = torch.zeros(2)
    hierarchical.average_parameters([p])  # step 2: the world
    sd = _roundtrip(hierarchical)

    outer = commhooks.OuterOptimizerAverager(1)
    donor = commhooks.OuterOptimizerAverager(1)
    other = torch.nn.Parameter(torch.ones(5))
    other.grad = torch.zeros(5)
    donor.average_parameters([other])  # first sync: takes a 5-element snapshot
    outer.load_state_dict(_roundtrip(donor))
    before = p.detach().clone()
    try:
        outer.average_parameters([p])
        mismatch = ""
    except ValueError as exc:
        mismatch = str(exc)
    return message, rebound, rederived, p.detach(), sd, mismatch, torch.equal(p, before)


def test_unpickled_states_rebind_and_recreate_groups_and_foreign_snapshots_fail():
    for result in run_on_ranks(_pickled_with_groups, 2):
        message, rebound, rederived, p, sd, mismatch, unchanged = result
        assert "state.bind(process_group, subgroup=" in message
        assert rebound and rederived
        assert torch.equal(p, torch.full((2,), 0.5))
        assert sd["kind"] == "hierarchical_model_averager" and sd["step"] == 3
        # A snapshot saved for another model is never applied to this one.
        assert "do not match the snapshot" in mismatch and unchanged


def test_accelerate_saves_and_restores_the_states(tmp_path):
    import accelerate  # a test dependency (the "test" extra)

    state, periodic, wrapper = _trained_objects()
    accelerator = accelerate.Accelerator(cpu=True)
    accelerator.register_for_checkpointing(state, periodic, wrapper)
    accelerator.save_state(str(tmp_path))
    state.iter, periodic.step, wrapper.averager.step = 0, 0, 0
    accelerator.load_state(str(tmp_path))
    assert (state.iter, periodic.step, wrapper.averager.step) == (7, 4, 9)


def test_torch_distributed_checkpoint_saves_and_restores_the_states(tmp_path):
    import torch.distributed.checkpoint as dcp

    state, _, wrapper = _trained_objects()
    dcp.save({"hook": state.state_dict(), "opt": wrapper.state_dict()}, checkpoint_id=tmp_path)
    fresh_state = commhooks.PostLocalSGDState(None, None, 5)
    q = torch.nn.Parameter(torch.ones(3))
    inner = torch.optim.SGD([q], lr=0.1, momentum=0.9)
    q.grad = torch.zeros(3)
    inner.step()  # DCP loads in place: the target needs a momentum buffer to fill
    fresh = commhooks.PostLocalSGDOptimizer(inner, commhooks.PeriodicModelAverager(2))
    target = {"hook": fresh_state.state_dict(), "opt": fresh.state_dict()}
    dcp.load(target, checkpoint_id=tmp_path)
    fresh_state.load_state_dict(target["hook"])
    fresh.load_state_dict(target["opt"])
    assert fresh_state.iter == 7 and fresh.averager.step == 9
    assert torch.equal(fresh.state[q]["momentum_buffer"], torch.ones(3))
