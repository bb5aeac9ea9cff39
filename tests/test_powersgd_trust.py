"""PowerSGD under what a user can get wrong or suffer at run time, on 2 gloo ranks: a memory that
turns non-finite, sparse gradients, ranks with different hooks; and who owns the follow-ups."""

import gc
import math
import warnings
import weakref

import pytest
import torch
import torch.distributed as dist
from ddp_utils import batches, flat_grads, flat_params, make_ddp, make_mlp
from torch import nn

from commhooks import PowerSGDState, batched_powerSGD_hook, comm, powerSGD_hook
from commhooks.testing import run_on_ranks

pytestmark = pytest.mark.timeout(120)


def _poisoned_memory(rank, world_size, single_round):
    """Train, put a NaN into one matrix's and one vector's memory on rank 0, train on."""
    state = PowerSGDState(
        None, start_powerSGD_iter=0, matrix_approximation_rank=2, single_round=single_round
    )
    model = make_mlp()
    ddp = make_ddp(model, powerSGD_hook, state)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.02)
    finite = []
    for step, (x, y) in enumerate(batches(rank, 8)):
        if step == 3 and rank == 0:
            errors = state.error_dict
            matrix = next(k for k, t in errors.items() if t.dim() == 2)
            vector = next(k for k, t in errors.items() if t.dim() == 1)
            errors[matrix][0, 0] = math.nan
            errors[vector][0] = math.inf
        opt.zero_grad(set_to_none=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            nn.functional.mse_loss(ddp(x), y).backward()
        finite.append(bool(torch.isfinite(flat_grads(model)).all()))
        opt.step()
        if step == 3:
            messages = [str(w.message) for w in caught]
    memory_finite = all(bool(torch.isfinite(t).all()) for t in state.error_dict.values())
    return finite, messages, flat_params(model), memory_finite


@pytest.mark.parametrize("single_round", [False, True])
def test_a_memory_that_turns_non_finite_is_reset_and_training_goes_on(single_round):
    # The two-round variant stayed non-finite for good: a NaN added into the gradient cannot be
    # taken out again, so every later step fell back and sent NaN.
    results = run_on_ranks(_poisoned_memory, 2, single_round)
    for rank, (finite, messages, params, memory_finite) in enumerate(results):
        assert all(finite), finite
        assert memory_finite and torch.isfinite(params).all()
        assert torch.equal(params, results[0][2])
        reset = [m for m in messages if "held inf or NaN and was reset" in m]
        assert len(reset) == (2 if rank == 0 else 0), messages  # one for each memory


def _sparse(rank, world_size):
    model = nn.Sequential(nn.EmbeddingBag(10, 4, sparse=True), nn.Linear(4, 2))
    ddp = make_ddp(model, powerSGD_hook, PowerSGDState(None, start_powerSGD_iter=0))
    message = None
    try:
        ddp(torch.randint(0, 10, (3, 2))).sum().backward()
    except Exception as exc:  # raised inside backward, from the hook
        message = f"{type(exc).__name__}: {exc}"
    # Neither rank leaves while the other may still wait on the dense bucket's collectives:
    # a peer gone would make that rank's error the backend's, not the hook's.
    dist.barrier()
    return message


def test_sparse_gradients_are_refused_naming_the_hook_to_use():
    for message in run_on_ranks(_sparse, 2):
        assert message is not None and "cannot compress a sparse gradient (bucket" in message
        assert "sparse gradient" in message and "commhooks.allreduce_hook" in message


def _other_hooks(rank, world_size):
    hook = powerSGD_hook if rank == 0 else batched_powerSGD_hook
    ddp = make_ddp(make_mlp(), hook, PowerSGDState(None, start_powerSGD_iter=0))
    x, y = batches(rank, 1)[0]
    nn.functional.mse_loss(ddp(x), y).backward()


def test_ranks_with_different_powersgd_hooks_are_named_before_any_collective():
    with pytest.raises(
        Exception, match="rank 0: powerSGD_hook, no wrapper; rank 1: batched_powerSGD_hook"
    ):
        run_on_ranks(_other_hooks, 2)


def _issuers(rank, world_size):
    state = PowerSGDState(None, start_powerSGD_iter=0, single_round=True)
    ddp = make_ddp(make_mlp(), powerSGD_hook, state)
    x, y = batches(rank, 1)[0]
    nn.functional.mse_loss(ddp(x), y).backward()
    own = state.issuer is not comm.issuer_for(dist.group.WORLD)
    state_issuer = weakref.ref(state.issuer)
    del ddp, state
    group = dist.new_group([0, 1])
    issuer = comm.issuer_for(group)
    shared = comm.issuer_for(group) is issuer
    shared_issuer = weakref.ref(issuer)
    del issuer
    dist.destroy_process_group(group)
    del group
    gc.collect()
    return shared, shared_issuer() is None, own, state_issuer() is None


def test_follow_up_issuers_go_with_their_group_or_their_state():
    for shared, freed, own, state_freed in run_on_ranks(_issuers, 2):
        assert shared and freed  # a stateless hook's issuer lives as long as its group
        assert own and state_freed  # a state's issuer is its own and goes with it


ABSURD = tuple(
    ("power_sgd", {"start_powerSGD_iter": 0, "single_round": one}) for one in (False, True)
)


@pytest.fixture(scope="module")
def absurd():
    from ddp_utils import resume_each_with_absurd_memory

    return run_on_ranks(resume_each_with_absurd_memory, 2, ABSURD)


@pytest.mark.parametrize("case", [0, 1], ids=["two_rounds", "single_round"])
def test_an_absurd_loaded_memory_is_reset_at_the_first_step_naming_the_key(absurd, case):
    ranks = [r[case] for r in absurd]
    for r in ranks:
        assert r["finite"] and max(r["losses"]) < 10, r["losses"]
        assert not r["still_checking"]  # a one-off check: later steps make none
    reset = [w for w in ranks[0]["warnings"] if "out of all proportion" in w]
    named = {k for k in ranks[0]["keys"] if any(f"(key '{k}')" in w for w in reset)}
    assert named and named == set(ranks[0]["keys"])
    assert not any("out of all proportion" in w for w in ranks[1]["warnings"])
