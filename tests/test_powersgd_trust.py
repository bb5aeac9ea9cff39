"""PowerSGD under what a user can get wrong or suffer at run time, on 2 gloo ranks: sparse
gradients, ranks with different hooks, an absurd loaded memory; and who owns the follow-ups."""

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from ddp_utils import batches, make_ddp, make_mlp
from torch import nn

from commhooks import PowerSGDState, batched_powerSGD_hook, comm, powerSGD_hook
from commhooks.testing import run_on_ranks

pytestmark = pytest.mark.timeout(120)


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


def test_loaded_memories_of_parameters_no_longer_trained_are_dropped_after_a_step():
    from ddp_utils import resume_with_the_first_layer_frozen

    options = {"start_powerSGD_iter": 2}
    for r in run_on_ranks(resume_with_the_first_layer_frozen, 2, "power_sgd", options):
        assert r["saved"] == [str(n) for n in range(8)]
        assert r["kept"] == [str(n) for n in range(6)] and not r["checking"]
        assert r["factors"] == ["1", "3", "5"]  # the matrices' warm starts, #7's dropped too
        dropped = [w for w in r["warnings"] if "met no gradient in a whole step" in w]
        assert len(dropped) == 1 and "keys [6, 7])" in dropped[0], r["warnings"]


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
