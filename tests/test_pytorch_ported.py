"""PyTorch's own tests of the model averagers and ``PostLocalSGDOptimizer``, run on commhooks.

Ported from ``torch/testing/_internal/distributed/distributed_test.py`` (the averager,
``average_parameters`` and ``PostLocalSGDOptimizer`` reload tests) to CPU and gloo: the same
scenarios and expectations, against commhooks' objects. Code written with PyTorch's tests
in mind must behave the same here.
"""

import copy
import os
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
from ddp_utils import IN, OUT, make_mlp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks
from commhooks.averaging.parameters import get_params_to_average
from commhooks.testing import run_on_ranks


def _average_parameters(rank, world_size):
    model = nn.Sequential(nn.Conv2d(3, 3, kernel_size=3, padding=1), nn.ReLU(), nn.Linear(1, 5))
    for p in model.parameters():
        p.data = torch.ones_like(p.data)
    commhooks.average_parameters(model.parameters(), None)
    global_same = all(torch.equal(p, torch.ones_like(p)) for p in model.parameters())
    for p in model.parameters():
        p.data = torch.ones_like(p.data) * rank
    pair = dist.new_group([0, 1])  # rank 2 is outside: its parameters must not change
    commhooks.average_parameters(model.parameters(), pair)
    expected = 0.5 if rank < 2 else float(rank)
    partial = all(torch.equal(p, torch.full_like(p, expected)) for p in model.parameters())
    return global_same, partial


def test_average_parameters():
    for global_same, partial in run_on_ranks(_average_parameters, 3):
        assert global_same and partial


def test_get_params_to_average_takes_parameters_and_param_groups():
    model = nn.Linear(2, 3)
    assert get_params_to_average(model.parameters()) == []
    model.weight.grad = torch.zeros_like(model.weight)
    assert get_params_to_average(model.parameters()) == [model.weight]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert get_params_to_average(opt.param_groups) == [model.weight]
    assert commhooks.get_params_to_average is get_params_to_average
    with pytest.raises(TypeError, match="param_groups"):
        get_params_to_average([1])


def _periodic(rank, world_size, use_param_groups):
    model = nn.Linear(1, 5, bias=False)
    param = next(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    expected_avg = torch.ones_like(param.data) * sum(range(world_size)) / world_size
    wrong = []
    for warmup_steps in [12, 13, 14, 15]:
        averager = commhooks.PeriodicModelAverager(period=4, warmup_steps=warmup_steps)
        for step in range(20):
            param.data = torch.ones_like(param.data) * rank
            param.grad = torch.ones_like(param.data) * rank
            averager.average_parameters(opt.param_groups if use_param_groups else [param])
            due = step >= warmup_steps and (step - warmup_steps) % 4 == 0
            want = expected_avg if due else torch.ones_like(param.data) * rank
            if not torch.equal(param.data, want):
                wrong.append((warmup_steps, step))
    return wrong


@pytest.mark.parametrize("use_param_groups", [False, True], ids=["params", "param_groups"])
def test_periodic_model_averager(use_param_groups):
    for wrong in run_on_ranks(_periodic, 2, use_param_groups):
        assert wrong == []


def _one_level(rank, world_size):
    model = nn.Linear(1, 5, bias=False)
    param = next(model.parameters())
    tensor = torch.ones_like(param.data) * rank
    expected_avg = torch.ones_like(param.data) * sum(range(world_size)) / world_size
    wrong = []
    for warmup_steps in [12, 13, 14, 15]:
        averager = commhooks.HierarchicalModelAverager(
            period_group_size_dict=OrderedDict([(4, world_size)]), warmup_steps=warmup_steps
        )
        for step in range(20):
            param.data = copy.deepcopy(tensor)
            param.grad = torch.ones_like(param.data)
            averager.average_parameters(model.parameters())
            # Unlike the periodic averager, the hierarchy counts periods from step 0.
            due = step >= warmup_steps and step % 4 == 0
            if not torch.equal(param.data, expected_avg if due else tensor):
                wrong.append((warmup_steps, step))
    return wrong


def test_1_level_hierarchical_model_averager():
    for wrong in run_on_ranks(_one_level, 2):
        assert wrong == []


def _three_levels(rank, world_size):
    model = nn.Linear(1, 5, bias=False)
    param = next(model.parameters())
    tensor = torch.ones_like(param.data) * rank
    levels = OrderedDict([(2, 2), (4, 4), (8, world_size)])
    averager = commhooks.HierarchicalModelAverager(period_group_size_dict=levels, warmup_steps=10)
    groups = averager.period_process_group_dict
    ranks1 = dist.get_process_group_ranks(groups[2])
    ranks2 = dist.get_process_group_ranks(groups[4])
    avg1 = torch.ones_like(param.data) * sum(ranks1) / 2
    avg2 = torch.ones_like(param.data) * sum(ranks2) / 4
    global_avg = torch.ones_like(param.data) * sum(range(world_size)) / world_size
    wrong = []
    for step in range(25):
        param.data = copy.deepcopy(tensor)
        param.grad = torch.ones_like(param.data)
        averager.average_parameters(model.parameters())
        if step in (16, 24):
            want = global_avg
        elif step in (12, 20):
            want = avg2
        elif step in (10, 14, 18, 22):
            want = avg1
        else:
            want = tensor
        if not torch.equal(param.data, want):
            wrong.append(step)
    return type(groups).__name__, list(groups), ranks1, ranks2, wrong


def test_3_level_hierarchical_model_averager():
    for rank, result in enumerate(run_on_ranks(_three_levels, 4)):
        kind, periods, ranks1, ranks2, wrong = result
        assert kind == "OrderedDict" and periods == [2, 4, 8]
        assert ranks1 == [rank // 2 * 2, rank // 2 * 2 + 1]
        assert ranks2 == [0, 1, 2, 3]
        assert wrong == []


def _step_reload(rank, world_size, path):
    net = DDP(make_mlp())

    def make_opt(averager):
        inner = torch.optim.SGD(net.parameters(), lr=0.03)
        return commhooks.PostLocalSGDOptimizer(optim=inner, averager=averager)

    averager = commhooks.PeriodicModelAverager(period=4, warmup_steps=10)
    opt = make_opt(averager)
    averager2 = commhooks.PeriodicModelAverager(period=4, warmup_steps=10)
    dummy = make_opt(averager2)
    x, y = torch.randn(world_size * 2, IN), torch.randn(world_size * 2, OUT)
    for _ in range(20):
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    if rank == 0:
        torch.save({"optimizer_state_dict": opt.state_dict()}, path)
    dist.barrier()
    checkpoint = torch.load(path)
    dummy.load_state_dict(checkpoint["optimizer_state_dict"])
    steps = (averager.step, averager2.step)
    del checkpoint["optimizer_state_dict"]["step"]
    with pytest.warns(UserWarning, match="no 'step'.*restarts at step 0"):
        dummy.load_state_dict(checkpoint["optimizer_state_dict"])
    reference = {k: v for k, v in opt.state_dict().items() if k not in ("step", "averager")}
    del reference["kind"], reference["version"]  # PyTorch's own format, without a step
    with pytest.warns(UserWarning, match="no 'step'"):
        dummy.load_state_dict(reference)
    return steps, averager2.step


def test_post_local_sgd_optimizer_step_reload(tmp_path):
    path = os.path.join(tmp_path, "ckpt.pt")
    for (step, reloaded), after in run_on_ranks(_step_reload, 2, path):
        assert reloaded != 0 and reloaded == step
        assert after == 0


def _groups_of_one(rank, world_size):
    from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import (
        HierarchicalModelAverager as TorchHierarchical,
    )

    levels = OrderedDict([(1, 1), (2, 2), (4, world_size)])
    ours = commhooks.HierarchicalModelAverager(period_group_size_dict=levels)
    theirs = TorchHierarchical(period_group_size_dict=levels)
    mine = {p: dist.get_process_group_ranks(g) for p, g in ours.period_process_group_dict.items()}
    want = {p: dist.get_process_group_ranks(g) for p, g in theirs.period_process_group_dict.items()}
    # Averaging in the level of one rank leaves the parameter as it is, as in PyTorch.
    param = torch.full((3,), float(rank), requires_grad=True)
    param.grad = torch.zeros_like(param)
    ours.step = 1  # due only at the level of period 1
    ours.average_parameters([param])
    return mine, want, param.detach().tolist()


def test_hierarchical_level_of_one_rank_is_a_group_of_that_rank_as_in_pytorch():
    for rank, (mine, want, param) in enumerate(run_on_ranks(_groups_of_one, 4)):
        assert mine == want
        assert mine[1] == [rank]  # not None, which torch.distributed reads as the world
        assert param == [float(rank)] * 3
