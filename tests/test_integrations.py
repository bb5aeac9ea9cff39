"""Checkpointing hook state through Accelerate, Lightning and torch.distributed.checkpoint.

Every test runs on a tiny ``HookState`` of its own whose content differs between ranks (the
hard case: frameworks write one file from rank 0) and on every stateful hook registered in
``commhooks.config``, trained far enough that its buffers exist.
"""

import os
from collections.abc import Mapping
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ddp_utils import batches, flat_params, make_ddp, make_mlp, train

import commhooks
from commhooks import allreduce_hook, config, register
from commhooks.config import CommHookType, HookConfig, hook_names, hook_spec
from commhooks.integrations.checkpoint import DistributedCheckpointState, PerRankState
from commhooks.state import HookState, StateDictError, StatelessState
from commhooks.testing import RankError, run_on_ranks

FAST_OPTIONS = {"start_powerSGD_iter": 2, "start_localSGD_iter": 2, "sync_every": 2}
STEPS = 5
ENV = {"OMP_NUM_THREADS": "1"}


class Tally(HookState):
    """A per-rank buffer allocated on first use, and a step counter."""

    kind = "test_tally"

    def __init__(self, process_group: Any = None) -> None:
        super().__init__(process_group)
        self.steps, self.error = 0, None

    def fill(self, rank: int) -> "Tally":
        self.steps, self.error = 7, torch.arange(4.0) + 10 * rank
        return self

    def _save(self) -> dict[str, Any]:
        out: dict[str, Any] = {"steps": self.steps}
        if self.error is not None:
            out["error"] = self.error.clone()
        return out

    def _load(self, state_dict: Mapping[str, Any]) -> None:
        steps, error = state_dict["steps"], state_dict.get("error")
        if not isinstance(steps, int) or not (error is None or isinstance(error, torch.Tensor)):
            raise StateDictError("bad tally")
        self.steps, self.error = steps, None if error is None else error.clone()


def stateful_hooks() -> list[str]:
    return [h for h in hook_names() if HookConfig(h, options=fast_options(h)).stateful]


def fast_options(hook: str) -> dict:
    return {k: v for k, v in FAST_OPTIONS.items() if k in hook_spec(hook).options}


def same(a: Any, b: Any) -> bool:
    """Deep equality of state dicts (tensors bitwise)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def trained_states(rank: int) -> dict[str, Any]:
    """The tiny state and every registered stateful hook's state after a few steps."""
    states: dict[str, Any] = {"tally": Tally().fill(rank)}
    for hook in stateful_hooks():
        ddp = make_ddp(make_mlp())
        states[hook] = register(ddp, hook, **fast_options(hook))
        train(ddp, batches(rank, STEPS))
    return states


def fresh_states() -> dict[str, Any]:
    states: dict[str, Any] = {"tally": Tally()}
    for hook in stateful_hooks():
        states[hook] = register(make_ddp(make_mlp()), hook, **fast_options(hook))
    return states


# -- PerRankState: one file written by rank 0 --------------------------------------------------
def _per_rank_file(rank, world_size, path):
    states = trained_states(rank)
    saved = {name: s.state_dict() for name, s in states.items()}
    for name, state in states.items():
        sd = PerRankState(state).state_dict()
        if rank == 0:
            torch.save(sd, f"{path}.{name}")
    torch.distributed.barrier()
    fresh = fresh_states()
    for name, state in fresh.items():
        PerRankState(state).load_state_dict(torch.load(f"{path}.{name}", weights_only=True))
    return {name: same(saved[name], s.state_dict()) for name, s in fresh.items()}


def test_per_rank_state_gives_each_rank_its_own_state_back(tmp_path):
    for rank, ok in enumerate(run_on_ranks(_per_rank_file, 2, str(tmp_path / "hook"))):
        assert ok and all(ok.values()), f"rank {rank}: {ok}"
    sd = torch.load(tmp_path / "hook.tally", weights_only=True)
    assert sd["world_size"] == 2
    assert [e["error"][0].item() for e in sd["ranks"]] == [0.0, 10.0]


def _resize(rank, world_size, path, allow):
    state = Tally()
    PerRankState(state, allow_resize=allow).load_state_dict(torch.load(path, weights_only=True))
    return state.error


def _three_ranks_file(rank, world_size, path):
    sd = PerRankState(Tally().fill(rank)).state_dict()
    if rank == 0:
        torch.save(sd, path)


def test_per_rank_state_other_world_size(tmp_path):
    path = str(tmp_path / "three")
    run_on_ranks(_three_ranks_file, 3, path)
    with pytest.raises(RankError, match="hook state of 3 ranks, and 2 are loading it"):
        run_on_ranks(_resize, 2, path, False)
    for error in run_on_ranks(_resize, 2, path, True):
        assert torch.equal(error, torch.arange(4.0))


def test_per_rank_state_rejects_a_foreign_dict():
    state = Tally().fill(1)
    with pytest.raises(StateDictError, match="not a commhooks state dict"):
        PerRankState(state).load_state_dict({"error": torch.zeros(4)})
    with pytest.raises(StateDictError, match="'test_tally' state, not 'per_rank'"):
        PerRankState(state).load_state_dict(state.state_dict())
    with pytest.raises(TypeError, match="got None: no hook is registered"):
        PerRankState(None)  # hook_state(model) in a single process
    with pytest.raises(TypeError, match="Stateless hooks"):
        PerRankState(object())
    assert state.steps == 7


# -- torch.distributed.checkpoint --------------------------------------------------------------
def _dcp(rank, world_size, path):
    import torch.distributed.checkpoint as dcp

    states = trained_states(rank)
    saved = {name: s.state_dict() for name, s in states.items()}
    model = make_mlp(seed=rank)
    dcp.save(
        {
            "model": model.state_dict(),
            **{k: DistributedCheckpointState(s) for k, s in states.items()},
        },
        checkpoint_id=path,
    )
    # Plain values and tensors that are the same on every rank also go in directly.
    counter = Tally()
    counter.steps = 11
    dcp.save({"counter": counter.state_dict()}, checkpoint_id=path + "-plain")

    fresh, target = fresh_states(), make_mlp(seed=5)
    dcp.load(
        {
            "model": target.state_dict(),
            **{k: DistributedCheckpointState(s) for k, s in fresh.items()},
        },
        checkpoint_id=path,
    )
    template = {"counter": Tally().state_dict()}
    dcp.load(template, checkpoint_id=path + "-plain")
    restored = Tally()
    restored.load_state_dict(template["counter"])
    out = {name: same(saved[name], s.state_dict()) for name, s in fresh.items()}
    out["plain"] = restored.steps == 11
    return out


def test_distributed_checkpoint_round_trip(tmp_path):
    for rank, ok in enumerate(run_on_ranks(_dcp, 2, str(tmp_path / "dcp"), env=ENV)):
        assert all(ok.values()), f"rank {rank}: {ok}"


# -- Accelerate: register_for_checkpointing, save_state / load_state ----------------------------
def _accelerate(rank, world_size, directory):
    from accelerate import Accelerator

    from commhooks.integrations.accelerate import find_ddp, register_hook

    accelerator = Accelerator(cpu=True)
    tally = Tally().fill(rank)
    accelerator.register_for_checkpointing(PerRankState(tally))
    models, states = {}, {"tally": tally}
    for hook in stateful_hooks():
        models[hook] = accelerator.prepare(make_mlp())
        states[hook] = register_hook(accelerator, models[hook], hook, **fast_options(hook))
    plain = accelerator.prepare(make_mlp())
    stateless = register_hook(accelerator, plain, "allreduce", "bf16")
    for model in models.values():
        train(model, batches(rank, STEPS))
    saved = {name: s.state_dict() for name, s in states.items()}
    accelerator.save_state(directory)

    tally.steps, tally.error = 0, None
    for model in models.values():
        train(model, batches(rank, 2, seed=9))
    accelerator.load_state(directory)
    out = {name: same(saved[name], s.state_dict()) for name, s in states.items()}
    out["stateless_not_registered"] = isinstance(stateless, StatelessState) and len(
        accelerator._custom_objects
    ) == len(states)
    out["registered_on_ddp"] = len(find_ddp(plain)._comm_hooks) == 1
    for name, call in {
        "unprepared": lambda: register_hook(accelerator, make_mlp(), "fp16"),
        "bad_option": lambda: register_hook(accelerator, plain, "fp16", rank=2),
        "twice": lambda: register_hook(accelerator, plain, "fp16"),
    }.items():
        try:
            call()
            out[name] = "accepted"
        except (TypeError, ValueError) as exc:
            out[name] = str(exc)
    return out


def test_accelerate_save_state_and_load_state(tmp_path):
    directory = str(tmp_path / "accel")
    for rank, out in enumerate(run_on_ranks(_accelerate, 2, directory, env=ENV)):
        messages = {k: out.pop(k) for k in ("unprepared", "bad_option", "twice")}
        assert all(out.values()), f"rank {rank}: {out}"
        assert "Pass the prepared model" in messages["unprepared"]
        assert "unknown option 'rank'" in messages["bad_option"]
        assert "already has a communication hook" in messages["twice"]
    # Accelerate writes custom objects from rank 0 only; the file holds both ranks' state.
    tally = torch.load(os.path.join(directory, "custom_checkpoint_0.pkl"), weights_only=True)
    assert [e["error"][0].item() for e in tally["ranks"]] == [0.0, 10.0]


# -- Accelerate's own way: DistributedDataParallelKwargs(comm_hook=...) ------------------------
def _accelerate_kwargs_handler(rank, world_size, directory):
    from accelerate import Accelerator
    from accelerate.utils import DDPCommunicationHookType

    from commhooks.integrations.accelerate import (
        DistributedDataParallelKwargs,
        find_ddp,
        hook_state,
    )

    # Written for Accelerate's handler; only the import of DistributedDataParallelKwargs changed.
    kwargs = DistributedDataParallelKwargs(
        comm_hook=DDPCommunicationHookType.POWER_SGD,
        comm_wrapper=DDPCommunicationHookType.FP16,
        comm_state_option={"start_powerSGD_iter": 2, "matrix_approximation_rank": 1},
        bucket_cap_mb=1,
    )
    accelerator = Accelerator(cpu=True, kwargs_handlers=[kwargs])
    model, optimizer = accelerator.prepare(make_mlp(), torch.optim.SGD(make_mlp().parameters()))
    state = hook_state(model)
    accelerator.register_for_checkpointing(PerRankState(state))
    train(model, batches(rank, STEPS))
    saved = state.state_dict()
    accelerator.save_state(directory)
    train(model, batches(rank, 2, seed=9))
    accelerator.load_state(directory)
    ddp = find_ddp(model)
    return {
        "handler": accelerator.ddp_handler is kwargs,
        "state": type(state).__name__,
        "compressed": state.iter == STEPS and state.compression_stats()[0] > 1,
        "bucket_cap": ddp.bucket_bytes_cap == 1024 * 1024,
        "params": flat_params(model),
        "restored": same(saved, state.state_dict()),
        "plain_model": hook_state(make_mlp()) is None,
    }


def test_accelerate_kwargs_handler_registers_our_hook_and_state(tmp_path):
    pytest.importorskip("accelerate")
    results = run_on_ranks(_accelerate_kwargs_handler, 2, str(tmp_path / "ckpt"), env=ENV)
    params = [out.pop("params") for out in results]
    for out in results:
        assert out == {
            "handler": True,
            "state": "PowerSGDState",
            "compressed": True,
            "bucket_cap": True,
            "restored": True,
            "plain_model": True,
        }
    # PowerSGD keeps the replicas identical, through the fp16 wrapper too.
    assert torch.equal(params[0], params[1])


def test_accelerate_kwargs_handler_is_accelerates_own_and_validates():
    accelerate = pytest.importorskip("accelerate")
    from commhooks.integrations.accelerate import DistributedDataParallelKwargs

    handler = DistributedDataParallelKwargs(
        comm_hook="post_local_sgd",
        comm_state_option={"start_localSGD_iter": 10},
        bucket_cap_mb=5,
        find_unused_parameters=True,
    )
    # Accelerate finds its handlers by exact class; DDP gets only DDP's arguments.
    assert type(handler) is accelerate.utils.DistributedDataParallelKwargs
    assert handler.to_kwargs() == {"bucket_cap_mb": 5, "find_unused_parameters": True}
    assert handler.comm_hook == "post_local_sgd"
    assert handler.comm_state_option == {"start_localSGD_iter": 10}
    for kwargs, error, match in (
        ({"comm_hook": "powersgd"}, ValueError, "Did you mean 'power_sgd'"),
        ({"comm_hook": "fp16", "comm_wrapper": "bf61"}, ValueError, "unknown wrapper 'bf61'"),
        (
            {"comm_hook": "fp16", "comm_state_option": {"matrix_approximation_rank": 2}},
            ValueError,
            "does not apply to hook 'fp16'",
        ),
        ({"comm_hook": "post_local_sgd"}, ValueError, "needs the option"),
        ({"bucket_cap": 5}, TypeError, "bucket_cap_mb"),
    ):
        with pytest.raises(error, match=match):
            DistributedDataParallelKwargs(**kwargs)


class SingleProcessAccelerator:
    """What register_hook reads of an ``Accelerator`` that runs one process."""

    num_processes = 1

    def register_for_checkpointing(self, *objects: Any) -> None:
        raise AssertionError("nothing is registered with a single process")


@pytest.mark.parametrize(
    ("args", "options", "expected"),
    [
        (("powersgd",), {}, "Did you mean 'power_sgd'"),
        (("fp16", "bf61"), {}, "unknown wrapper 'bf61'"),
        (("power_sgd",), {"matrix_aproximation_rank": 2}, "Did you mean 'matrix_approx"),
        (("fp16",), {"matrix_approximation_rank": 2}, "does not apply to hook 'fp16'"),
        (("power_sgd_single_round",), {"single_round": False}, "Use hook 'power_sgd'"),
    ],
)
def test_accelerate_single_process_still_validates(monkeypatch, args, options, expected):
    from commhooks import _warnings
    from commhooks.integrations.accelerate import register_hook

    monkeypatch.setattr(_warnings, "_seen", set())
    with pytest.raises(ValueError, match=expected):
        register_hook(SingleProcessAccelerator(), make_mlp(), *args, **options)
    with pytest.warns(RuntimeWarning, match="single process"):
        state = register_hook(SingleProcessAccelerator(), make_mlp(), "power_sgd", "fp16")
    assert state is None


def test_quantized_names_pass_through_the_integrations(monkeypatch):
    from commhooks import _warnings
    from commhooks.integrations.accelerate import register_hook

    monkeypatch.setattr(_warnings, "_seen", set())
    assert {"int8", "int4"} <= set(stateful_hooks())  # checkpointed by the tests above too
    with pytest.raises(ValueError, match="does not take wrapper 'bf16'"):
        register_hook(SingleProcessAccelerator(), make_mlp(), "int8", "bf16")
    with pytest.raises(ValueError, match="Did you mean 'block_size'"):
        register_hook(SingleProcessAccelerator(), make_mlp(), "int4", blok_size=64)
    with pytest.warns(RuntimeWarning, match="single process"):
        assert register_hook(SingleProcessAccelerator(), make_mlp(), "int4", block_size=64) is None
    pytest.importorskip("lightning")
    from commhooks.integrations.lightning import CommHookDDPStrategy

    strategy = CommHookDDPStrategy("INT4", hook_options={"block_size": 128})
    assert strategy.hook_config.to_dict() == {"hook": "int4", "wrapper": "no", "block_size": 128}
    with pytest.raises(ValueError, match="does not take wrapper 'fp16'"):
        CommHookDDPStrategy("int8", "fp16")


# -- Lightning: the strategy's checkpoint entry --------------------------------------------------
def _lightning_strategy(rank, world_size, path):
    pytest.importorskip("lightning")
    from lightning.fabric.plugins.environments import LightningEnvironment

    from commhooks.integrations.lightning import CHECKPOINT_KEY, CommHookDDPStrategy

    def strategy() -> CommHookDDPStrategy:
        env = LightningEnvironment()
        env.set_world_size(world_size)
        env.set_global_rank(rank)
        return CommHookDDPStrategy("allreduce", cluster_environment=env)

    saving = strategy()
    states = trained_states(rank)
    checkpoints = {}
    for name, state in states.items():
        saving.hook_state = state
        checkpoint = {"epoch": 1}
        saving.save_checkpoint(checkpoint, f"{path}.{name}")
        checkpoints[name] = CHECKPOINT_KEY in checkpoint
    torch.distributed.barrier()
    out = {}
    for name, state in fresh_states().items():
        loading = strategy()
        loading.hook_state = state  # as after configure_ddp
        loaded = loading.load_checkpoint(f"{path}.{name}")
        out[name] = (
            checkpoints[name]
            and loaded["epoch"] == 1
            and same(states[name].state_dict(), state.state_dict())
        )
    # Resuming: Lightning loads the checkpoint before configure_ddp builds the DDP model; the
    # state waits for the hook. A stand-in stateful hook keeps a Tally.
    from lightning.pytorch.strategies import DDPStrategy

    def wrap_model(self):
        self.model = make_ddp(make_mlp())

    DDPStrategy.configure_ddp = wrap_model
    specs = config._specs()
    specs[CommHookType.POWER_SGD] = config.HookSpec(tally_hook, lambda g, o: Tally(g))
    config._specs = lambda: specs
    pending = CommHookDDPStrategy("power_sgd", cluster_environment=strategy().cluster_environment)
    pending.load_checkpoint(f"{path}.tally")
    out["pending"] = pending.hook_state is None and pending._pending_hook_state is not None
    pending.configure_ddp()
    out["resumed"] = same(pending.hook_state.state_dict(), states["tally"].state_dict())
    stateless = strategy()
    stateless.load_checkpoint(f"{path}.tally")
    try:
        stateless.configure_ddp()
        out["stateless_refuses"] = False
    except ValueError as exc:
        out["stateless_refuses"] = "keeps none" in str(exc)
    # DDPStrategy's own arguments, which it registers only on CUDA: registered here, on CPU.
    lightning_state = commhooks.PowerSGDState(None, start_powerSGD_iter=0)
    lightning_style = CommHookDDPStrategy(
        ddp_comm_state=lightning_state,
        ddp_comm_hook=commhooks.powerSGD_hook,
        ddp_comm_wrapper=commhooks.fp16_compress_wrapper,
        cluster_environment=strategy().cluster_environment,
    )
    lightning_style.configure_ddp()
    x, y = batches(rank, 1)[0]
    torch.nn.functional.mse_loss(lightning_style.model(x), y).backward()
    out["ddp_comm_kwargs"] = lightning_style.hook_state is lightning_state and (
        lightning_state.iter == 1 and lightning_state.compression_stats()[0] > 1
    )
    return out


def tally_hook(state: Tally, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return allreduce_hook(None, bucket)


def test_lightning_strategy_checkpoints_every_ranks_hook_state(tmp_path):
    pytest.importorskip("lightning")
    for rank, ok in enumerate(run_on_ranks(_lightning_strategy, 2, str(tmp_path / "l"), env=ENV)):
        assert all(ok.values()), f"rank {rank}: {ok}"


def test_lightning_strategy_validates_at_construction():
    pytest.importorskip("lightning")
    from commhooks.integrations.lightning import CommHookDDPStrategy

    with pytest.raises(ValueError, match="Did you mean 'power_sgd'|unknown hook 'powersgd'"):
        CommHookDDPStrategy("powersgd")
    with pytest.raises(ValueError, match="not both"):
        CommHookDDPStrategy("fp16", ddp_comm_hook=lambda s, b: None)
    with pytest.raises(ValueError, match="hook_process_group=.*not both"):
        CommHookDDPStrategy(hook_process_group=object(), ddp_comm_hook=lambda s, b: None)
    named = CommHookDDPStrategy(ddp_comm_hook=commhooks.powerSGD_hook)
    assert named.hook_name == "powerSGD_hook"  # what its errors name, not 'allreduce'
    assert CommHookDDPStrategy("int8").hook_name == "int8"
    with pytest.raises(ValueError, match="need ddp_comm_hook"):
        CommHookDDPStrategy(ddp_comm_state=object())
    assert CommHookDDPStrategy("FP16", "bf16").hook_config.to_dict() == {
        "hook": "fp16",
        "wrapper": "bf16",
    }


def _lightning_diloco(rank, world_size):
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch.strategies import DDPStrategy

    from commhooks.integrations.lightning import CommHookDDPStrategy

    env = LightningEnvironment()
    env.set_world_size(world_size)
    env.set_global_rank(rank)
    DDPStrategy.configure_ddp = lambda self: setattr(self, "model", make_ddp(make_mlp()))
    options = {"sync_every": 4, "fragments": 2, "fragment_sync_delay": 1}
    strategy = CommHookDDPStrategy(
        "streaming_diloco", hook_options=options, cluster_environment=env
    )
    strategy.configure_ddp()
    opt = torch.optim.SGD(strategy.model.parameters(), lr=0.05)
    strategy.optimizers = [opt, opt]
    try:
        strategy.attach_averager()
        refused = False
    except ValueError as exc:
        refused = "Return one optimizer" in str(exc)
    strategy.optimizers = [opt]
    strategy.attach_averager()
    strategy.attach_averager()  # once only
    train(strategy.model, batches(rank, 7), optimizer=opt)
    flying = strategy.hook_state.in_flight is not None  # fragment 1, issued after step 7
    strategy.on_train_end()
    state = strategy.hook_state
    return refused, flying, state.step, state.in_flight, dict(state.snapshot)


def test_lightning_strategy_runs_the_diloco_averager_after_each_step():
    pytest.importorskip("lightning")
    results = run_on_ranks(_lightning_diloco, 2, env=ENV)
    for refused, flying, step, in_flight, _ in results:
        assert refused and flying and step == 7 and in_flight is None
    for name, tensor in results[0][4].items():
        assert torch.equal(tensor, results[1][4][name])
