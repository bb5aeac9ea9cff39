"""Failures that must be loud and early: mismatched options, non-finite gradients, raising hooks.

Multi-rank (gloo, 2 ranks). Each rank catches its own error and returns it, so a test sees what
every rank saw, and how long it took, instead of only the first rank that failed.
"""

import os
import time

import pytest
import torch
import torch.distributed as dist
from ddp_utils import batches, count_gathers, flat_grads, flat_params, make_mlp, outcome
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks
from commhooks.testing import run_on_ranks

# ----------------------------------------------------------------------------------------------
# Options that differ between ranks
# ----------------------------------------------------------------------------------------------
# (object, option, value on rank 0, value on rank 1)
MISMATCHES = [
    ("PowerSGDState", "matrix_approximation_rank", 1, 2),
    ("PowerSGDState", "start_powerSGD_iter", 2, 3),
    ("PowerSGDState", "single_round", False, True),
    ("PowerSGDState", "iter", 0, 1),  # resumed from checkpoints of different steps
    ("PostLocalSGDState", "start_localSGD_iter", 2, 3),
    ("PostLocalSGDState", "post_local_gradient_allreduce", True, False),
    ("PeriodicModelAverager", "period", 2, 3),
    ("PeriodicModelAverager", "warmup_steps", 0, 1),
    ("HierarchicalModelAverager", "period_group_size_dict", {2: 2}, {3: 2}),
    ("HierarchicalModelAverager", "warmup_steps", 0, 1),
    ("OuterOptimizerAverager", "period", 2, 3),
    ("OuterOptimizerAverager", "outer_lr", 0.7, 0.5),
    ("OuterOptimizerAverager", "outer_momentum", 0.9, 0.0),
]


def _build(kind, options):
    """The object and a function running one training step with it."""
    if kind in ("PowerSGDState", "PostLocalSGDState"):
        if kind == "PowerSGDState":
            steps = options.pop("iter", 0)
            state = commhooks.PowerSGDState(None, **{"start_powerSGD_iter": 2, **options})
            state.iter = steps
            hook = commhooks.powerSGD_hook
        else:
            # An explicit subgroup, so that the only gather is the option check.
            options = {"start_localSGD_iter": 2, **options}
            state = commhooks.PostLocalSGDState(None, dist.group.WORLD, **options)
            hook = commhooks.post_localSGD_hook
        ddp = DDP(make_mlp(), bucket_cap_mb=0.004)
        ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)

        def step(x, y):
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()

        return state, step
    if kind == "HierarchicalModelAverager":
        levels = options.pop("period_group_size_dict", {2: 2})
        averager = commhooks.HierarchicalModelAverager(levels, **options)
    else:
        averager = getattr(commhooks, kind)(**{"period": 2, **options})
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        averager.average_parameters(model.parameters())

    return averager, step


def _mismatched(rank, world_size):
    """Every case in one launch: the check fails on both ranks alike, leaving the group usable."""
    out = {}
    for kind, option, *values in MISMATCHES:
        _, step = _build(kind, {option: values[rank]})
        error = "no error"
        try:
            for x, y in batches(rank, 3):
                step(x, y)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        out[f"{kind}-{option}"] = error
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def mismatch_errors():
    return run_on_ranks(_mismatched, 2, timeout=120, pg_timeout=30)


@pytest.mark.parametrize(
    ("kind", "option"), [m[:2] for m in MISMATCHES], ids=[f"{k}-{o}" for k, o, *_ in MISMATCHES]
)
def test_options_differing_between_ranks_are_named_on_first_use(kind, option, mismatch_errors):
    for rank, errors in enumerate(mismatch_errors):
        error = errors[f"{kind}-{option}"]
        assert error.startswith("ValueError"), f"rank {rank}: {error}"
        assert option in error, f"rank {rank}: the differing option is not named: {error}"
        assert "rank 0=" in error and "rank 1=" in error, error


def _gathers_per_step(rank, world_size):
    return {
        _once_id(kind, options): count_gathers(_build(kind, dict(options))[1], batches(rank, 6))
        for kind, options in ONCE
    }


ONCE = [
    ("PowerSGDState", {}),
    ("PowerSGDState", {"single_round": True}),
    ("PostLocalSGDState", {}),
    ("PeriodicModelAverager", {}),
    ("HierarchicalModelAverager", {}),
    ("OuterOptimizerAverager", {}),
]


def _once_id(kind, options):
    return kind + "".join(f"-{k}" for k in options)


@pytest.fixture(scope="module")
def gathers_per_step():
    return run_on_ranks(_gathers_per_step, 2)


@pytest.mark.parametrize(("kind", "options"), ONCE, ids=[_once_id(k, o) for k, o in ONCE])
def test_the_option_check_is_one_gather_on_first_use_only(kind, options, gathers_per_step):
    # 6 steps, across the start of compression / local SGD and several averagings.
    for per_rank in gathers_per_step:
        per_step = per_rank[_once_id(kind, options)]
        assert per_step == [1, 0, 0, 0, 0, 0], per_step


# ----------------------------------------------------------------------------------------------
# Non-finite gradients
# ----------------------------------------------------------------------------------------------
HOOKS = {
    "allreduce": {},
    "fp16": {},
    "bf16": {},
    "power_sgd": {"matrix_approximation_rank": 2, "start_powerSGD_iter": 1},
    "power_sgd_single_round": {"matrix_approximation_rank": 2, "start_powerSGD_iter": 1},
    "batched_power_sgd": {"start_powerSGD_iter": 1},
    "post_local_sgd": {"start_localSGD_iter": 2},
}
BAD_STEP = 3  # after PowerSGD's start (memory exists) and after post-local SGD's warm-up


def _poison(grad):
    grad = grad.clone()
    grad[0, 0] = float("nan")
    return grad


def _memory(state):
    if not isinstance(state, commhooks.PowerSGDState):
        return {}
    stores = {"error": state.error_dict, "q": state.q_memory_dict, "p": state.p_memory_dict}
    return {f"{name}.{k}": t.clone() for name, store in stores.items() for k, t in store.items()}


def _train_through_a_bad_step(rank, world_size, name, how):
    """Train with a non-finite gradient on rank 0 at BAD_STEP, skipping that optimizer step."""
    model = make_mlp()
    ddp = DDP(model, bucket_cap_mb=0.004)
    state = commhooks.register(ddp, name, **HOOKS[name]) if name else None
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    first = model[0].weight
    out = {"losses": []}
    for step, (x, y) in enumerate(batches(rank, BAD_STEP + 4)):
        bad = step == BAD_STEP and rank == 0
        handle = None
        if bad and how == "element":
            handle = first.register_hook(_poison)
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(ddp(x), y)
        if bad and how == "loss":  # what an overflowing loss scale does to every gradient
            loss = loss * float("inf")
        if step == BAD_STEP:
            out["memory_before"] = _memory(state)
        loss.backward()
        if handle is not None:
            handle.remove()
        grads = flat_grads(model)
        if step == BAD_STEP:
            out["grads"] = grads
            out["memory_after"] = _memory(state)
            if isinstance(state, commhooks.PowerSGDState) and not name.startswith("batched"):
                out["bad_ordinal"] = state.numbering.number_of(first)
        if torch.isfinite(grads).all():  # what a loss scaler does: skip a non-finite step
            opt.step()
        out["losses"].append(loss.item())
    out["params"] = flat_params(model)
    return out


def _all_hooks_through_a_bad_step(rank, world_size, how):
    """Every hook (and DDP without one, as the reference) in one launch."""
    out = {}
    for name in [None, *HOOKS]:
        try:
            out[name] = _train_through_a_bad_step(rank, world_size, name, how)
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def bad_element():
    return run_on_ranks(_all_hooks_through_a_bad_step, 2, "element")


@pytest.fixture(scope="module")
def bad_loss():
    return run_on_ranks(_all_hooks_through_a_bad_step, 2, "loss")


def _results(per_rank, name):
    results = [r[name] for r in per_rank]
    for rank, r in enumerate(results):
        assert isinstance(r, dict), f"{name}: rank {rank} raised {r}"
    return results


def _same_with_nan(a, b):
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(
        torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0)
    )


def _check_bad_step(results, name):
    grads = [r["grads"] for r in results]
    for rank, g in enumerate(grads):
        assert not torch.isfinite(g).all(), f"{name}: rank {rank} does not see the bad gradient"
    assert _same_with_nan(grads[0], grads[1]), f"{name}: ranks differ after the bad step"
    for r in results:
        if "power_sgd" in name:  # compression had started: there is memory to protect
            assert r["memory_before"] and r["memory_after"], f"{name}: no memory to check"
        for key, t in r["memory_after"].items():
            assert torch.isfinite(t).all(), f"{name}: non-finite values entered {key}"
    # Training goes on, finite and in sync, once the bad step is skipped.
    for rank, r in enumerate(results):
        assert torch.isfinite(r["params"]).all(), f"{name}: rank {rank} parameters non-finite"
        later = r["losses"][BAD_STEP + 1 :]
        assert all(torch.isfinite(torch.tensor(later))), f"{name}: rank {rank} losses {later}"
    assert torch.equal(results[0]["params"], results[1]["params"]), f"{name}: replicas diverged"


@pytest.mark.parametrize("name", list(HOOKS))
def test_a_nan_in_one_gradient_passes_through_like_plain_allreduce(name, bad_element):
    results = _results(bad_element, name)
    _check_bad_step(results, name)
    expected_bad = ~torch.isfinite(_results(bad_element, None)[0]["grads"])
    got_bad = ~torch.isfinite(results[0]["grads"])
    if "power_sgd" in name:  # as PyTorch's PowerSGD: the NaN spreads over its matrix
        assert got_bad[expected_bad].all(), f"{name}: lost where plain allreduce has it"
    else:
        assert torch.equal(got_bad, expected_bad), f"{name}: not where plain allreduce has it"
    for rank, r in enumerate(results):
        if "bad_ordinal" in r:  # the bad parameter's memory did not take that step
            key = r["bad_ordinal"]
            assert f"error.{key}" in r["memory_before"], "the bad parameter had no error memory"
            for store in ("error", "q", "p"):
                k = f"{store}.{key}"
                if k in r["memory_before"]:
                    _assert_kept(name, rank, k, r["memory_before"][k], r["memory_after"][k])


@pytest.mark.parametrize("name", list(HOOKS))
def test_an_overflowing_loss_on_one_rank_leaves_the_memory_untouched(name, bad_loss):
    results = _results(bad_loss, name)
    _check_bad_step(results, name)
    for rank, r in enumerate(results):
        before, after = r["memory_before"], r["memory_after"]
        assert before.keys() == after.keys()
        for k in before:
            _assert_kept(name, rank, k, before[k], after[k])


def _assert_kept(name, rank, key, before, after):
    """Memory is kept through a skipped step: bit for bit, except in one documented case.

    The single-round variant adds each rank's gradient into its error memory as it forms the
    factor it sends; a rank whose own gradient was finite (rank 1 here) takes it back out when
    the result shows another rank's was not, which restores the old memory to the rounding of
    that addition. Rank 0 stops at its first block that is not finite: its memory is kept
    exactly when, as here, that is the first block.
    """
    if name == "power_sgd_single_round" and rank == 1 and key.startswith("error."):
        scale = max(before.abs().max().item(), 1e-12)
        torch.testing.assert_close(after, before, rtol=0, atol=1e-6 * scale)
    else:
        assert torch.equal(before, after), f"{name}: {key} changed in the skipped step"


# ----------------------------------------------------------------------------------------------
# A hook that raises synchronously on one rank
# ----------------------------------------------------------------------------------------------
PG_TIMEOUT = 5

WRONG_STATE = {
    # hook, its state on rank 0, a wrong state on rank 1
    "powerSGD_hook": lambda: (commhooks.PowerSGDState(None, start_powerSGD_iter=0), None),
    "allreduce_hook": lambda: (None, commhooks.PowerSGDState(None)),
    "post_localSGD_hook": lambda: (commhooks.PostLocalSGDState(None, None, 1), None),
}


def _raises_on_rank_1(rank, world_size, hook_name, flag_dir):
    good, wrong = WRONG_STATE[hook_name]()
    ddp = DDP(make_mlp(), bucket_cap_mb=0.004)
    ddp.register_comm_hook(good if rank == 0 else wrong, getattr(commhooks, hook_name))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    start = time.monotonic()
    error = "no error"
    try:
        for x, y in batches(rank, 3):
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    elapsed = time.monotonic() - start
    flag = os.path.join(flag_dir, "rank0-done")
    if rank == 0:
        open(flag, "w").close()
    else:
        # Stay alive, as a rank that logs its error and goes on would: the other rank must get
        # its error from the process group's timeout, not from this process exiting.
        deadline = time.monotonic() + 6 * PG_TIMEOUT
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.1)
    return error, elapsed


@pytest.mark.parametrize("hook_name", list(WRONG_STATE))
def test_a_hook_raising_on_one_rank_errors_there_and_does_not_hang_the_other(hook_name, tmp_path):
    results = run_on_ranks(
        _raises_on_rank_1, 2, hook_name, str(tmp_path), timeout=60, pg_timeout=PG_TIMEOUT
    )
    (error0, elapsed0), (error1, _) = results
    assert error1.startswith("TypeError") and hook_name in error1, error1
    assert "state" in error1, error1
    assert error0 != "no error", "rank 0 finished training although rank 1 never communicated"
    assert elapsed0 < 3 * PG_TIMEOUT, f"rank 0 took {elapsed0:.1f}s to fail: {error0}"


# ----------------------------------------------------------------------------------------------
# Degenerate parameters
# ----------------------------------------------------------------------------------------------
class WithEmptyLayer(nn.Module):
    """A model with a zero-size parameter (a layer with no outputs), which DDP accepts."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(32, 16)
        self.empty = nn.Linear(16, 0)
        self.b = nn.Linear(16, 8)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.b(h) + self.empty(h).sum()


def _train_with_an_empty_layer(rank, name):
    ddp = DDP(WithEmptyLayer(), bucket_cap_mb=0.004)
    commhooks.register(ddp, name, **HOOKS[name])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for x, y in batches(rank, 4):
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return flat_params(ddp.module)


def _empty_parameter(rank, world_size):
    return {name: outcome(lambda: _train_with_an_empty_layer(rank, name)) for name in HOOKS}  # noqa: B023


@pytest.fixture(scope="module")
def empty_parameter():
    return run_on_ranks(_empty_parameter, 2, timeout=90, pg_timeout=20)


@pytest.mark.parametrize("name", list(HOOKS))
def test_a_zero_size_parameter_is_accepted(name, empty_parameter):
    params = [r[name] for r in empty_parameter]
    for rank, p in enumerate(params):
        assert isinstance(p, torch.Tensor), f"{name}: rank {rank} raised {p}"
    assert torch.isfinite(params[0]).all() and torch.equal(params[0], params[1])
