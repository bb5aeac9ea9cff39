"""Averagers attached to an optimizer's step: same results as calling them, state by name.

``averager.attach(optimizer, model.named_parameters())`` runs the averager after every
``optimizer.step()``; the outer optimizer's snapshot is keyed by parameter name, so a
checkpoint resumes into a rebuilt model and optimizer, and old positional state dicts load.
"""

import functools
import io

import torch
from ddp_utils import batches, flat_params, make_mlp
from torch import nn

import commhooks
from commhooks.testing import run_on_ranks

STEPS, SAVE_AT = 9, 5
MAKERS = {
    "periodic": functools.partial(commhooks.PeriodicModelAverager, 2, warmup_steps=1),
    "outer": functools.partial(commhooks.OuterOptimizerAverager, 2, warmup_steps=2),
    "hierarchical": functools.partial(commhooks.HierarchicalModelAverager, {2: 1, 3: 2}),
}


def _step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _train(rank, make, how, data):
    model = make_mlp(seed=rank)  # replicas start apart: averaging is visible
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    averager = make()
    if how == "attached":
        averager.attach(opt, model.named_parameters())
    for x, y in data:
        _step(model, opt, x, y)
        if how == "called":
            averager.average_parameters(model.parameters())
    return model, opt, averager


def _attached_vs_called(rank, world_size):
    data = batches(rank, STEPS)
    out = {}
    for name, make in MAKERS.items():
        called = _train(rank, make, "called", data)
        attached = _train(rank, make, "attached", data)
        out[name] = (flat_params(called[0]), flat_params(attached[0]), attached[2].step)
    outer = _train(rank, MAKERS["outer"], "attached", data)[2]
    return out, sorted(outer.snapshot)


def test_attach_averages_after_every_step_exactly_as_calling_it():
    for out, names in run_on_ranks(_attached_vs_called, 2):
        for name, (called, attached, step) in out.items():
            assert torch.equal(called, attached), name
            assert step == STEPS, name
        assert names == sorted(n for n, _ in make_mlp().named_parameters())


def _resume(rank, world_size, reorder):
    data = batches(rank, STEPS)
    uninterrupted = _train(rank, MAKERS["outer"], "attached", data)[0]
    model, opt, averager = _train(rank, MAKERS["outer"], "attached", data[:SAVE_AT])
    saved = {"model": model.state_dict(), "opt": opt.state_dict(), "avg": averager.state_dict()}
    if reorder == "positional":  # the format of earlier releases: a list, by position
        positions = list(saved["avg"]["snapshot"].values())
        saved["avg"] = {**saved["avg"], "version": 1, "snapshot": positions}
    saved = torch.load(_through_bytes(saved), weights_only=True)
    fresh = make_mlp(seed=99)
    fresh.load_state_dict(saved["model"])
    params = list(fresh.named_parameters())
    if reorder == "reversed":  # another optimizer layout: only the names still match
        params = params[::-1]
        opt2 = torch.optim.SGD([p for _, p in params], lr=0.05, momentum=0.9)
        saved["opt"] = _reversed_optimizer_state(saved["opt"])
    else:
        opt2 = torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
    opt2.load_state_dict(saved["opt"])
    averager2 = MAKERS["outer"]()
    averager2.load_state_dict(saved["avg"])
    averager2.attach(opt2, fresh.named_parameters())
    for x, y in data[SAVE_AT:]:
        _step(fresh, opt2, x, y)
    return flat_params(uninterrupted), flat_params(fresh)


def _through_bytes(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def _reversed_optimizer_state(sd):
    count = len(sd["param_groups"][0]["params"])
    state = {count - 1 - i: s for i, s in sd["state"].items()}
    return {"state": state, "param_groups": sd["param_groups"]}


def test_a_checkpoint_resumes_into_a_rebuilt_model_and_optimizer():
    for reorder in ("same", "reversed", "positional"):
        for uninterrupted, resumed in run_on_ranks(_resume, 2, reorder):
            assert torch.equal(uninterrupted, resumed), reorder


def _detached(rank, world_size):
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    averager = commhooks.PeriodicModelAverager(1, warmup_steps=100)
    handle = averager.attach(opt)
    x, y = batches(rank, 1)[0]
    _step(model, opt, x, y)
    before = averager.step
    handle.remove()
    _step(model, opt, x, y)
    return before, averager.step


def test_the_handle_detaches_the_averager():
    for before, after in run_on_ranks(_detached, 2):
        assert (before, after) == (1, 1)
