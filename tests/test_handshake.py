"""The cross-rank handshake: ranks that registered different hooks are told so, before anything
mismatched is sent; and a hook group that is not the DDP model's is refused or reported.

Without the handshake, PowerSGD against its batched variant or against plain allreduce makes
gloo abort the process ("Received data size doesn't match", exit -6), and an fp16 wrapper on
one rank only hangs in group creation.
"""

import functools
import os
import time

import pytest
import torch
import torch.distributed as dist
from ddp_utils import batches, count_gathers, make_mlp, outcome
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks
from commhooks.testing import run_on_ranks


def _powersgd(batched=False):
    hook = commhooks.batched_powerSGD_hook if batched else commhooks.powerSGD_hook
    return lambda: (commhooks.PowerSGDState(None, start_powerSGD_iter=0), hook)


def _stateless(hook):
    return lambda: (None, hook)


# name: (what rank 0 registers, what rank 1 registers, what each rank's message must name)
MISMATCHES = {
    "powersgd-vs-batched": (
        _powersgd(),
        _powersgd(batched=True),
        ["rank 0: powerSGD_hook, no wrapper", "rank 1: batched_powerSGD_hook, no wrapper"],
    ),
    "powersgd-vs-allreduce": (
        _powersgd(),
        _stateless(commhooks.allreduce_hook),
        ["rank 0: powerSGD_hook", "rank 1: allreduce_hook"],
    ),
    "fp16-wrapper-on-one-rank": (
        _stateless(commhooks.fp16_compress_wrapper(commhooks.allreduce_hook)),
        _stateless(commhooks.allreduce_hook),
        ["rank 0: allreduce_hook under fp16_compress_wrapper", "rank 1: allreduce_hook, no"],
    ),
    "allreduce-vs-fp16": (
        _stateless(commhooks.allreduce_hook),
        _stateless(commhooks.fp16_compress_hook),
        ["rank 0: allreduce_hook", "rank 1: fp16_compress_hook"],
    ),
    "wrapped-powersgd-vs-plain": (
        lambda: (
            commhooks.PowerSGDState(None, start_powerSGD_iter=0),
            commhooks.bf16_compress_wrapper(commhooks.powerSGD_hook),
        ),
        _powersgd(),
        ["rank 0: powerSGD_hook under bf16_compress_wrapper", "rank 1: powerSGD_hook, no"],
    ),
}


def _step(ddp, x, y):
    nn.functional.mse_loss(ddp(x), y).backward()


def _train_two_steps(rank, state, hook):
    ddp = DDP(make_mlp(), bucket_cap_mb=0.004)
    ddp.register_comm_hook(state, hook)
    for x, y in batches(rank, 2):
        _step(ddp, x, y)
    return "no error"


def _mismatched(rank, world_size):
    """Every case in one launch: the handshake fails alike on both ranks, the group stays usable."""
    out = {}
    for name, (zero, one, _) in MISMATCHES.items():
        state, hook = (zero if rank == 0 else one)()
        out[name] = outcome(lambda: _train_two_steps(rank, state, hook))  # noqa: B023
    return out


@pytest.fixture(scope="module")
def mismatch_errors():
    return run_on_ranks(_mismatched, 2, timeout=120, pg_timeout=30)


@pytest.mark.parametrize("name", list(MISMATCHES))
def test_different_hooks_raise_a_value_error_naming_each_ranks_hook(name, mismatch_errors):
    for rank, errors in enumerate(mismatch_errors):
        error = errors[name]
        assert error.startswith("ValueError"), f"rank {rank}: {error}"
        assert "registered different communication hooks" in error, error
        for part in MISMATCHES[name][2]:
            assert part in error, f"rank {rank}: {part!r} not in {error}"


def _wrapped_options_differ(rank, world_size):
    state = commhooks.PowerSGDState(None, matrix_approximation_rank=1 + rank, start_powerSGD_iter=0)
    ddp = DDP(make_mlp(), bucket_cap_mb=0.004)
    ddp.register_comm_hook(state, commhooks.fp16_compress_wrapper(commhooks.powerSGD_hook))
    try:
        _step(ddp, *batches(rank, 1)[0])
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_a_wrapper_checks_its_inner_state_too():
    for error in run_on_ranks(_wrapped_options_differ, 2, pg_timeout=30):
        assert "matrix_approximation_rank: rank 0=1, rank 1=2" in error, error


def _policies(rank, world_size):
    """Stateless hooks registered with each rank's own ``on_nonfinite``, or in two equivalent
    ways: what one step raised on this rank, case by case."""

    def run(register):
        ddp = DDP(make_mlp(), bucket_cap_mb=0.004)
        register(ddp)
        _step(ddp, *batches(rank, 1)[0])
        return "no error"

    repair = {"on_nonfinite": "repair"} if rank == 0 else {}
    cases = {
        "fp16": lambda ddp: commhooks.register(ddp, "fp16", **repair),
        "wrapped": lambda ddp: ddp.register_comm_hook(
            commhooks.StatelessState(None, **repair),
            commhooks.bf16_compress_wrapper(commhooks.allreduce_hook),
        ),
        "equivalent": lambda ddp: (
            commhooks.register(ddp, "allreduce")
            if rank == 0
            else ddp.register_comm_hook(None, commhooks.allreduce_hook)
        ),
    }
    return {name: outcome(lambda r=register: run(r)) for name, register in cases.items()}


def test_ranks_that_would_repair_differently_are_told_before_a_bucket_is_sent():
    # One rank repairing non-finite buckets sends them again, alone: a hang on NCCL.
    for errors in run_on_ranks(_policies, 2, timeout=120, pg_timeout=30):
        for name in ("fp16", "wrapped"):
            assert errors[name].startswith("ValueError"), errors[name]
            assert "on_nonfinite" in errors[name] and "'repair'" in errors[name], errors[name]
        assert errors["equivalent"] == "no error"


HOOK_KINDS = {
    "allreduce": lambda: (None, commhooks.allreduce_hook),
    "fp16": lambda: (None, commhooks.fp16_compress_hook),
    "bf16": lambda: (None, commhooks.bf16_compress_hook),
    "noop": lambda: (None, commhooks.noop_hook),
    "power_sgd": lambda: (
        commhooks.PowerSGDState(None, start_powerSGD_iter=2),
        commhooks.powerSGD_hook,
    ),
    "batched_power_sgd": lambda: (
        commhooks.PowerSGDState(None, start_powerSGD_iter=2),
        commhooks.batched_powerSGD_hook,
    ),
    "post_local_sgd": lambda: (
        commhooks.PostLocalSGDState(None, dist.group.WORLD, 2),
        commhooks.post_localSGD_hook,
    ),
    "fp16_wrapper_power_sgd": lambda: (
        commhooks.PowerSGDState(None, start_powerSGD_iter=2),
        commhooks.fp16_compress_wrapper(commhooks.powerSGD_hook),
    ),
    "bf16_wrapper_allreduce": lambda: (
        None,
        commhooks.bf16_compress_wrapper(commhooks.allreduce_hook),
    ),
}


def _gathers_per_step(rank, world_size):
    out = {}
    for name, make in HOOK_KINDS.items():
        state, hook = make()
        ddp = DDP(make_mlp(), bucket_cap_mb=0.004)
        ddp.register_comm_hook(state, hook)
        out[name] = count_gathers(functools.partial(_step, ddp), batches(rank, 4))
    return out


@pytest.fixture(scope="module")
def gathers():
    return run_on_ranks(_gathers_per_step, 2)


@pytest.mark.parametrize("name", list(HOOK_KINDS))
def test_every_hook_gathers_once_at_its_first_call_only(name, gathers):
    # 4 steps, across PowerSGD's and post-local SGD's switch at step 2 and DDP's rebuild.
    for per_rank in gathers:
        assert per_rank[name] == [1, 0, 0, 0], per_rank[name]


# ----------------------------------------------------------------------------------------------
# A hook group other than the DDP model's (3 ranks, the hook on ranks 0 and 1)
# ----------------------------------------------------------------------------------------------
PG_TIMEOUT = 10


def _register_on_a_subgroup(rank, world_size):
    pair = dist.new_group([0, 1])
    ddp = DDP(make_mlp(), bucket_cap_mb=0.004)
    errors = {}
    for hook in ("allreduce", "power_sgd"):
        try:
            commhooks.register(ddp, hook, process_group=pair)
            errors[hook] = "no error"
        except ValueError as exc:
            errors[hook] = str(exc)
    return errors


def test_register_refuses_a_group_other_than_the_ddp_models_on_every_rank():
    for rank, errors in enumerate(run_on_ranks(_register_on_a_subgroup, 3, pg_timeout=30)):
        for hook, error in errors.items():
            if rank < 2:
                assert "holds global ranks [0, 1]" in error, f"{hook}: {error}"
                assert "synchronises ranks [0, 1, 2]" in error, f"{hook}: {error}"
            else:
                assert "is not a member of the process group" in error, f"{hook}: {error}"


def _hook_on_a_subgroup(rank, world_size, flag_dir):
    pair = dist.new_group([0, 1])
    ddp = DDP(make_mlp(), bucket_cap_mb=0.004)
    ddp.register_comm_hook(pair, commhooks.allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    start, error = time.monotonic(), "no error"
    try:
        for x, y in batches(rank, 3):
            opt.zero_grad(set_to_none=True)
            _step(ddp, x, y)
            opt.step()
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    elapsed = time.monotonic() - start
    open(os.path.join(flag_dir, f"rank{rank}-done"), "w").close()
    # Stay alive until the others are done, as a rank that logs its error and goes on would:
    # the others must not depend on this process exiting.
    deadline = time.monotonic() + 4 * PG_TIMEOUT
    while len(os.listdir(flag_dir)) < world_size and time.monotonic() < deadline:
        time.sleep(0.1)
    return error, elapsed


@pytest.mark.timeout(120)
def test_a_hook_on_another_group_than_ddps_fails_clearly_where_known_and_never_hangs(tmp_path):
    results = run_on_ranks(
        _hook_on_a_subgroup, 3, str(tmp_path), timeout=100, pg_timeout=PG_TIMEOUT
    )
    error2, _ = results[2]
    assert error2.startswith("ValueError") and "not a member" in error2, error2
    for rank in (0, 1):  # members cannot tell at their first step; they must not hang
        error, elapsed = results[rank]
        assert error != "no error", f"rank {rank} trained on although rank 2 never averaged"
        assert elapsed < 2 * PG_TIMEOUT + 10, f"rank {rank} took {elapsed:.1f}s: {error}"


RELOADED = (("int8", {}), ("power_sgd", {"start_powerSGD_iter": 0}))


def _reload_on_one_rank(rank, world_size, hook, options, source):
    """Train 5 steps; rank 0 alone reloads its state (``source``: its state now, or its state
    of step 3); train 3 more. Returns the outcome and the time it took, and the parameters."""
    from ddp_utils import make_ddp, train

    model = make_mlp()
    ddp = make_ddp(model)
    state = commhooks.register(ddp, hook, **options)
    data = batches(rank, 8)
    train(ddp, data[:3])
    earlier = state.state_dict()
    train(ddp, data[3:5])
    if rank == 0:
        state.load_state_dict(state.state_dict() if source == "now" else earlier)
    started = time.monotonic()
    if source == "now":
        result = outcome(lambda: train(ddp, data[5:]))
    else:  # no barrier after it: the group is broken on purpose
        try:
            result = train(ddp, data[5:])
        except RuntimeError as exc:
            result = f"RuntimeError: {exc}"
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return result, flat, time.monotonic() - started


def _reloads(rank, world_size):
    same = [_reload_on_one_rank(rank, world_size, h, o, "now") for h, o in RELOADED]
    return same, _reload_on_one_rank(rank, world_size, "int8", {}, "step 3")  # breaks the group


@pytest.fixture(scope="module")
def reloads():
    return run_on_ranks(_reloads, 2, pg_timeout=4, timeout=100)


@pytest.mark.parametrize("case", range(len(RELOADED)), ids=[h for h, _ in RELOADED])
def test_one_rank_reloading_its_state_mid_run_needs_no_new_handshake(reloads, case):
    ranks = [same[case] for same, _ in reloads]
    for result, _, seconds in ranks:
        assert isinstance(result, list) and len(result) == 3, result  # three losses
        assert seconds < 4
    assert torch.equal(ranks[0][1], ranks[1][1])


def test_one_rank_reloading_another_step_is_named_on_that_rank_within_the_timeout(reloads):
    (named, _, seconds), (other, _, other_seconds) = [broken for _, broken in reloads]
    assert "reloaded mid-run (from step 5 to step 3)" in named, named
    assert "did not reload" in named and seconds < 4 + 3
    assert isinstance(other, str) and other_seconds < 4 + 3, other  # an error, not a hang
