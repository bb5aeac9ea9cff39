"""commhooks.fsdp: the DDP hooks on FSDP2 gradient shards, averaged across machines.

Ranks stand for machines x ranks per machine: 4 ranks as 2 x 2 (shards of uneven and empty
size), and 2 ranks as 2 x 1. Each grid runs once, in one set of processes, and returns what the
tests below check, so that the processes and their connections are paid for once per grid.
"""

import datetime
import os
import signal
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks
from commhooks import comm
from commhooks.config import hook_spec
from commhooks.integrations.checkpoint import DistributedCheckpointState
from commhooks.testing import RankError, run_on_ranks

STEPS = 3
FAST = {"start_powerSGD_iter": 0, "matrix_approximation_rank": 1}
STATELESS_OR_LOCAL = ("allreduce", "noop")


class Gated(nn.Module):
    """A linear layer whose ``gate`` is used only where ``open`` is set: a parameter without a
    gradient on some ranks, in a module that every rank runs."""

    def __init__(self, width: int, open_: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width)
        self.gate = nn.Parameter(torch.ones(width))
        self.never = nn.Parameter(torch.zeros(3))  # no rank uses it
        self.frozen = nn.Parameter(torch.full((width,), 0.5), requires_grad=False)
        self.open = open_

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = (x * self.frozen) @ self.weight.t()
        return out * self.gate if self.open else out


def make_net(seed: int = 0, gate_open: bool = True) -> nn.Sequential:
    # Over 2 shards: 33 rows split 17/16, 5 rows split 3/2, and 1 row leaves the second empty.
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 33),
        nn.ReLU(),
        nn.Linear(33, 24),
        Gated(24, gate_open),
        nn.ReLU(),
        nn.Linear(24, 5),
        nn.Linear(5, 1),
    )


def shard(model: nn.Module, mesh, reduce_dtype: torch.dtype | None = None) -> nn.Module:
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def data(rank: int, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(rank)
    return [
        (torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)) for _ in range(steps)
    ]


def train(model: nn.Module, batches, accumulate: int = 1) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(0, len(batches), accumulate):
        opt.zero_grad(set_to_none=True)
        for i, (x, y) in enumerate(batches[step : step + accumulate]):
            sync = i == accumulate - 1
            if isinstance(model, DDP) and not sync:
                with model.no_sync():
                    nn.functional.mse_loss(model(x), y).backward()
                continue
            if not isinstance(model, DDP):
                model.set_requires_gradient_sync(sync)
            nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def full(model: nn.Module) -> torch.Tensor:
    """Every parameter, gathered from this machine's shards (a collective of the shard group)."""
    pieces = []
    for p in model.parameters():
        p = p.detach()
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        pieces.append(p.float().reshape(-1))
    return torch.cat(pieces)


def fsdp_run(mesh, hook: str, batches, reduce_dtype=None, gate_open=True, accumulate=1, **options):
    model = shard(make_net(gate_open=gate_open), mesh["shard"], reduce_dtype)
    state = commhooks.fsdp.register(model, hook, mesh=mesh, **options)
    train(model, batches, accumulate)
    return full(model), state


def compressors() -> list[tuple[str, dict]]:
    """Every hook for FSDP2 that changes what is sent, with options that compress from step 0."""
    out = []
    for name in commhooks.fsdp.hook_names():
        if name not in STATELESS_OR_LOCAL:
            accepted = hook_spec(name).options
            out.append((name, {k: v for k, v in FAST.items() if k in accepted}))
    return out


def mismatch_message(mesh, odd_rank: int) -> str:
    rank_ = 2 if dist.get_rank() == odd_rank else 1
    model = shard(make_net(), mesh["shard"])
    try:
        commhooks.fsdp.register(model, "power_sgd", mesh=mesh, matrix_approximation_rank=rank_)
    except ValueError as exc:
        return str(exc)
    return "no error"


def common_checks(rank: int, world_size: int, machines: int = 2) -> dict:
    """What both grids check; returns plain tensors and strings."""
    mesh = init_device_mesh(
        "cpu", (machines, world_size // machines), mesh_dim_names=("replicate", "shard")
    )
    batches = data(rank)
    gate_open = mesh.get_local_rank("replicate") == 0  # the gate trains on the first machine only
    out: dict = {"initial": full(shard(make_net(), mesh["shard"]))}
    out["allreduce"], _ = fsdp_run(mesh, "allreduce", batches, gate_open=gate_open)
    native = shard(make_net(gate_open=gate_open), mesh)
    native.set_reduce_scatter_unused_params(True)
    train(native, batches)
    out["native"] = full(native)
    ddp = DDP(make_net(gate_open=gate_open), find_unused_parameters=True)
    train(ddp, batches)
    out["ddp"] = full(ddp.module)
    out["noop"], _ = fsdp_run(mesh, "noop", batches)
    out["compressed"] = {
        name: fsdp_run(mesh, name, batches, **opts)[0] for name, opts in compressors()
    }
    out["full_rank"] = full_rank(mesh, batches)
    out["mismatch"] = mismatch_message(mesh, odd_rank=world_size - 1)
    return out


def full_rank(mesh, batches) -> tuple:
    model = shard(make_net(), mesh["shard"])
    state = commhooks.fsdp.register(
        model, "power_sgd", mesh=mesh, start_powerSGD_iter=0, matrix_approximation_rank=64
    )
    # Below 1 only here, so that full-rank factors (larger than the matrix) are really used.
    object.__setattr__(state.settings, "min_compression_rate", 0.5)  # below 1 only here
    train(model, batches)
    return full(model), len(state.q_memory_dict), fsdp_run(mesh, "allreduce", batches)[0]


# -- 4 ranks: 2 machines x 2 shards --------------------------------------------------------------
def grid_of_four(rank: int, world_size: int) -> dict:
    out = common_checks(rank, world_size)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    batches = data(rank)
    ours, _ = fsdp_run(mesh, "allreduce", batches, reduce_dtype=torch.bfloat16)
    native = shard(make_net(), mesh, torch.bfloat16)
    train(native, batches)
    out["bf16_reduce"] = (ours, full(native))
    out["by_group"] = by_replicate_group(mesh, batches)
    out["bf16_power_sgd"] = fsdp_run(mesh, "power_sgd", batches, torch.bfloat16, **FAST)[0]
    micro = data(rank, steps=2 * 3)
    ours, state = fsdp_run(mesh, "power_sgd", micro, accumulate=3, **FAST)
    plain, _ = fsdp_run(mesh, "allreduce", micro, accumulate=3)
    ddp = DDP(make_net(), find_unused_parameters=True)
    train(ddp, micro, accumulate=3)
    shards = shard(make_net(), mesh["shard"])
    local = sum(p.to_local().numel() for p in trained(shards))
    out["accumulation"] = (state.iter, state.compression_stats()[1], local, plain, full(ddp.module))
    out["neighbour"] = {hook: neighbour_files(mesh, rank, hook, opts) for hook, opts in NEIGHBOURS}
    out["two_hops"] = two_hops_on_machines_of_two(rank)
    return out


def two_hops_on_machines_of_two(rank: int) -> dict:
    """int8 over a replicate group of the four ranks (shards of one rank), labelled 2 machines
    of 2 ranks: whether it took two hops, and the parameters, with ``topology`` auto and flat."""
    os.environ[comm.topology.MACHINE_ID_VAR] = f"machine{rank // 2}"
    try:
        mesh = init_device_mesh("cpu", (4, 1), mesh_dim_names=("replicate", "shard"))
        runs = {}
        for topology in ("auto", "flat"):
            params, state = fsdp_run(mesh, "int8", data(rank), topology=topology)
            runs[topology] = state.hops is not None, params
        allreduce, _ = fsdp_run(mesh, "allreduce", data(rank))
    finally:
        del os.environ[comm.topology.MACHINE_ID_VAR]
    return {**runs, "allreduce": allreduce}


NEIGHBOURS = (("int8", {}), ("power_sgd", FAST))


def neighbour_files(mesh, rank: int, hook: str, options: dict) -> dict[str, list[str]]:
    """Train and save every rank's state; load into fresh states each rank's own file, then
    its shard neighbour's (rank ^ 1: the same rank in the replicate group), one step each."""
    import warnings

    batches = data(rank)
    model = shard(make_net(), mesh["shard"])
    state = commhooks.fsdp.register(model, hook, mesh=mesh, **options)
    train(model, batches)
    files: list = [None] * dist.get_world_size()
    dist.all_gather_object(files, state.state_dict())
    out = {}
    for name, source in (("own", rank), ("neighbour", rank ^ 1)):
        fresh = shard(make_net(), mesh["shard"])
        restored = commhooks.fsdp.register(fresh, hook, mesh=mesh, **options)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            restored.load_state_dict(files[source])
            train(fresh, batches[:1])
        out[name] = [str(w.message) for w in caught]
    return out


def by_replicate_group(mesh, batches) -> tuple:
    """Registered with replicate_group instead of the mesh; the world group is refused."""
    model = shard(make_net(), mesh["shard"])
    try:
        commhooks.fsdp.register(model, "allreduce", replicate_group=dist.group.WORLD)
        refused = "no error"
    except ValueError as exc:
        refused = str(exc)
    commhooks.fsdp.register(model, "allreduce", replicate_group=mesh.get_group("replicate"))
    train(model, batches)
    return full(model), fsdp_run(mesh, "allreduce", batches)[0], refused


@pytest.fixture(scope="module")
def four():
    return run_on_ranks(grid_of_four, 4, timeout=170)


# -- 2 ranks: 2 machines x 1 shard ----------------------------------------------------------------
def grid_of_two(rank: int, world_size: int, folder: str) -> dict:
    out = common_checks(rank, world_size)
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    out["resume"] = resume(mesh, rank, folder)
    out["errors"] = bad_arguments(mesh)
    out["non_finite"] = non_finite(mesh, rank)
    out["late_module"] = late_module(mesh)
    out["partial_sync"] = partial_sync(mesh)
    out["read_at_once"] = read_at_once(mesh, rank)
    out["sat_out"] = sat_out_after_a_load(mesh, rank)
    return out


def sat_out_after_a_load(mesh, rank: int) -> list[str]:
    """The warnings of steps after a load whose first ones leave a module out of the forward
    pass (it calls no hook then), for each compressor with memories."""
    messages, keys = [], []
    for hook, options in (("int8", {}), ("power_sgd", {"start_powerSGD_iter": 1})):
        model = sharded_heads(mesh, late=0)
        saved = commhooks.fsdp.register(model, hook, mesh=mesh, **options)
        train(model, data(rank, steps=2))
        fresh = sharded_heads(mesh, late=4)  # the head sits out three steps
        state = commhooks.fsdp.register(fresh, hook, mesh=mesh, **options)
        state.load_state_dict(saved.state_dict())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(fresh, data(rank, steps=5))
        messages += [str(w.message) for w in caught]
        keys.append((sorted(saved.state_dict()["error"]), sorted(state.state_dict()["error"])))
    return messages, keys


def read_at_once(mesh, rank: int) -> tuple:
    """Where FSDP2 reads the shard as soon as the hook returns, the hook waits for its result:
    two synchronising backward passes without zeroing (the second adds into the first), and a
    post-accumulate-grad hook (an optimizer in the backward pass) that records the gradient."""
    batches = data(rank, steps=2)
    model = shard(make_net(), mesh["shard"])
    commhooks.fsdp.register(model, "allreduce", mesh=mesh)
    seen = []
    model[0].weight.register_post_accumulate_grad_hook(
        lambda p: seen.append(p.grad.to_local().clone())
    )
    ddp = DDP(make_net(), find_unused_parameters=True)
    for x, y in batches:
        nn.functional.mse_loss(model(x), y).backward()
        nn.functional.mse_loss(ddp(x), y).backward()
        seen.append(ddp.module[0].weight.grad.clone())
    ours = torch.cat([p.grad.to_local().reshape(-1) for p in trained(model)])
    theirs = [p.grad if p.grad is not None else torch.zeros_like(p) for p in trained(ddp)]
    return seen, ours, torch.cat([g.reshape(-1) for g in theirs])


def non_finite(mesh, rank: int) -> dict:
    """One step with a NaN target on the first machine, after a step that fills the memory."""
    batches = data(rank, steps=2)
    if rank == 0:
        batches[1][1][0, 0] = float("nan")
    out = {}
    cases = {
        "allreduce": ("allreduce", {}),
        "power_sgd": ("power_sgd", FAST),
        "power_sgd_single_round": ("power_sgd_single_round", FAST),
        # Decided at each shard, whose result FSDP2 waits for before the next module's call.
        "repaired": ("power_sgd", {**FAST, "on_nonfinite": "repair"}),
    }
    for name, (hook, options) in cases.items():
        model = shard(make_net(), mesh["shard"])
        state = commhooks.fsdp.register(model, hook, mesh=mesh, **options)
        train(model, batches[:1])
        memory = {k: v.clone() for k, v in getattr(state, "error_dict", {}).items()}
        model.zero_grad(set_to_none=True)
        x, y = batches[1]
        nn.functional.mse_loss(model(x), y).backward()
        grads = torch.cat([p.grad.detach().full_tensor().reshape(-1) for p in trained(model)])
        after = getattr(state, "error_dict", {})
        kept = memory.keys() == after.keys() and all(
            torch.equal(memory[k], after[k]) for k in memory
        )
        out[name] = (torch.isfinite(grads), kept and len(memory) > 0)
    ddp = DDP(make_net(), find_unused_parameters=True)
    train(ddp, batches[:1])
    ddp.zero_grad(set_to_none=True)
    nn.functional.mse_loss(ddp(batches[1][0]), batches[1][1]).backward()
    out["ddp"] = torch.isfinite(
        torch.cat(
            [
                (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                for p in trained(ddp)
            ]
        )
    )
    return out


def trained(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


class Heads(nn.Module):
    """A trunk and a head that joins the forward pass at step ``late`` only."""

    def __init__(self, late: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.head, self.late, self.step = nn.Linear(16, 8), nn.Linear(8, 1), late, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.step += 1
        h = self.trunk(x).sum(1, keepdim=True)
        return h + self.head(self.trunk(x)) if self.step >= self.late else h


def sharded_heads(mesh, late: int) -> Heads:
    model = Heads(late)
    fully_shard(model.trunk, mesh=mesh["shard"])
    fully_shard(model.head, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    return model


def late_module(mesh) -> list[int]:
    """The step count while an FSDP module that joins at the third step."""
    model = sharded_heads(mesh, late=3)
    state = commhooks.fsdp.register(model, "power_sgd", mesh=mesh, start_powerSGD_iter=100)
    counts = []
    for x, y in data(dist.get_rank(), steps=4):
        nn.functional.mse_loss(model(x), y).backward()
        counts.append(state.iter)
    return counts


def partial_sync(mesh) -> str:
    """Gradient synchronisation turned off for one FSDP module only: refused with the fix."""
    model = sharded_heads(mesh, late=0)
    commhooks.fsdp.register(model, "power_sgd", mesh=mesh, start_powerSGD_iter=100)
    model.head.set_requires_gradient_sync(False)
    try:
        for x, y in data(dist.get_rank(), steps=2):
            nn.functional.mse_loss(model(x), y).backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def resume(mesh, rank: int, folder: str) -> tuple:
    """Train, save through dcp, train on; then load into a fresh model and state, train on."""
    import torch.distributed.checkpoint as dcp

    batches = data(rank, steps=6)
    options = {"start_powerSGD_iter": 1, "matrix_approximation_rank": 2}
    model = shard(make_net(), mesh["shard"])
    state = commhooks.fsdp.register(model, "power_sgd", mesh=mesh, **options)
    train(model, batches[:3])
    dcp.save(
        {"model": model.state_dict(), "hook": DistributedCheckpointState(state)},
        checkpoint_id=folder,
    )
    train(model, batches[3:])
    fresh = shard(make_net(seed=7), mesh["shard"])
    restored = commhooks.fsdp.register(fresh, "power_sgd", mesh=mesh, **options)
    target = {"model": fresh.state_dict(), "hook": DistributedCheckpointState(restored)}
    dcp.load(target, checkpoint_id=folder)
    fresh.load_state_dict(target["model"])
    train(fresh, batches[3:])
    return full(model), full(fresh), state.iter, restored.iter, len(state.error_dict)


def bad_arguments(mesh) -> dict[str, str]:
    def message(call) -> str:
        try:
            call()
        except (TypeError, ValueError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    sharded = shard(make_net(), mesh["shard"])
    flat = init_device_mesh("cpu", (2,), mesh_dim_names=("replicate",))
    renamed = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    register = commhooks.fsdp.register
    cases = {
        "no fsdp": lambda: register(make_net(), "allreduce", mesh=mesh),
        "both": lambda: register(sharded, "allreduce", mesh=mesh, replicate_group=dist.group.WORLD),
        "neither": lambda: register(sharded, "allreduce"),
        "1-d mesh": lambda: register(sharded, "allreduce", mesh=flat),
        "names": lambda: register(sharded, "allreduce", mesh=renamed),
        "typo": lambda: register(sharded, "power_sdg", mesh=mesh),
        "batched": lambda: register(sharded, "batched_power_sgd", mesh=mesh),
        "option": lambda: register(sharded, "power_sgd", mesh=mesh, matrix_rank=2),
        "value": lambda: register(sharded, "power_sgd", mesh=mesh, matrix_approximation_rank=0),
        "wrapper": lambda: register(sharded, "power_sgd", mesh=mesh, wrapper="fp16"),
        "native": lambda: register(shard(make_net(), mesh), "allreduce", mesh=mesh),
    }
    out = {name: message(call) for name, call in cases.items()}
    # Nothing above registered anything: the same model still takes a hook.
    out["after"] = repr(register(sharded, "allreduce", replicate_group=mesh.get_group("replicate")))
    out["twice"] = message(lambda: register(sharded, "allreduce", mesh=mesh))
    return out


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("fsdp") / "checkpoint")
    return run_on_ranks(grid_of_two, 2, folder, timeout=170)


GRIDS = ["four", "two"]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# -- the checks ----------------------------------------------------------------------------------
@pytest.mark.parametrize("grid", GRIDS)
def test_allreduce_equals_native_hsdp_and_ddp(grid, request):
    for r in request.getfixturevalue(grid):
        assert relative(r["allreduce"], r["native"]) <= 1e-5
        assert relative(r["allreduce"], r["ddp"]) <= 1e-5
        assert relative(r["allreduce"], r["initial"]) > 1e-3  # it trained


@pytest.mark.parametrize("grid", GRIDS)
def test_each_compressor_trains_and_keeps_the_replicas_identical(grid, request):
    results = request.getfixturevalue(grid)
    names = [name for name, _ in compressors()]
    assert {"fp16", "bf16", "power_sgd", "power_sgd_single_round"} <= set(names)
    for r in results:
        for name in names:
            ours = r["compressed"][name]
            assert torch.equal(ours, results[0]["compressed"][name]), name
            assert torch.isfinite(ours).all(), name
            # Closer to plain averaging than the start is: it trained, in the same direction.
            gap, start = relative(ours, r["allreduce"]), relative(r["initial"], r["allreduce"])
            assert gap < 0.25 * start, (name, gap, start)


@pytest.mark.parametrize("grid", GRIDS)
def test_noop_leaves_each_machine_its_own_model(grid, request):
    results = request.getfixturevalue(grid)
    assert not torch.equal(results[0]["noop"], results[-1]["noop"])
    assert torch.equal(results[0]["allreduce"], results[-1]["allreduce"])


@pytest.mark.parametrize("grid", GRIDS)
def test_powersgd_at_full_rank_equals_plain_averaging(grid, request):
    for r in request.getfixturevalue(grid):
        ours, compressed, plain = r["full_rank"]
        assert compressed >= 3  # every weight shard of the first layers
        assert relative(ours, plain) <= 1e-5


@pytest.mark.parametrize("grid", GRIDS)
def test_options_that_differ_between_ranks_raise_on_every_rank(grid, request):
    results = request.getfixturevalue(grid)
    last = len(results) - 1
    for r in results:
        assert "configured differently" in r["mismatch"], r["mismatch"]
        assert f"rank {last}=2" in r["mismatch"] and "rank 0=1" in r["mismatch"]


def test_bf16_reduce_dtype_equals_native_hsdp(four):
    for r in four:
        ours, native = r["bf16_reduce"]
        assert relative(ours, native) <= 1e-5
        assert relative(ours, r["allreduce"]) < 1e-2  # bfloat16 rounding only
        assert torch.isfinite(r["bf16_power_sgd"]).all()
        assert torch.equal(r["bf16_power_sgd"], four[0]["bf16_power_sgd"])


def test_int8_across_machines_of_two_ranks_takes_two_hops_under_fsdp2(four):
    for r in four:
        (hops, params), (flat_hops, flat) = r["two_hops"]["auto"], r["two_hops"]["flat"]
        assert hops and not flat_hops
        assert torch.equal(params, four[0]["two_hops"]["auto"][1])  # the same bits everywhere
        exact = r["two_hops"]["allreduce"]  # both paths quantize, within int8's error
        assert 0 < relative(params, exact) < 5e-4 and 0 < relative(flat, exact) < 5e-4


def test_replicate_group_works_as_the_mesh_does(four):
    for r in four:
        ours, by_mesh, refused = r["by_group"]
        assert torch.equal(ours, by_mesh)
        assert "shares ranks" in refused and "mesh" in refused, refused


def test_gradient_accumulation_counts_optimizer_steps(four):
    for r in four:
        steps, elements, local, plain, ddp = r["accumulation"]
        assert steps == 2  # 6 micro-batches, 2 optimizer steps
        assert elements == 2 * local  # one hook call per module and optimizer step
        assert relative(plain, ddp) <= 1e-5


def test_a_shard_neighbours_file_resets_the_memories_with_a_warning(four):
    for rank, r in enumerate(four):
        for hook, _ in NEIGHBOURS:
            own, neighbour = r["neighbour"][hook]["own"], r["neighbour"][hook]["neighbour"]
            assert not [w for w in own if "reset" in w], own
            reset = [w for w in neighbour if "reset" in w]
            assert len(reset) == 1, (hook, neighbour)
            saved_at, used_at = f"shard rank {(rank ^ 1) % 2} of 2", f"shard rank {rank % 2} of 2"
            assert saved_at in reset[0] and used_at in reset[0], reset[0]


def test_checkpoint_and_resume_through_dcp(two):
    for r in two:
        continued, resumed, iters, restored_iters, memory = r["resume"]
        assert memory > 0 and iters == restored_iters == 6
        assert torch.equal(continued, resumed)


def test_bad_arguments_raise_before_training(two):
    errors = two[0]["errors"]
    expected = {
        "no fsdp": "no FSDP module",
        "both": "given both",
        "neither": "given neither",
        "1-d mesh": "must be 2-D",
        "names": "'replicate' and 'shard'",
        "typo": "Did you mean 'power_sgd'",
        "batched": "Use 'power_sgd'",
        "option": "Did you mean 'matrix_approximation_rank'",
        "value": "matrix_approximation_rank must be an integer >= 1",
        "wrapper": "use hook 'fp16' or 'bf16'",
        "native": "native HSDP",
        "twice": "already has a commhooks hook",
    }
    for case, text in expected.items():
        assert text in errors[case], (case, errors[case])
        assert errors[case].startswith(("ValueError", "TypeError")), (case, errors[case])
    assert errors["after"].startswith("StatelessState(")


def test_non_finite_gradients_come_back_where_ddp_puts_them(two):
    for r in two:
        found = r["non_finite"]
        assert not found["ddp"].all()  # the NaN reached the gradients
        for hook in ("allreduce", "repaired"):  # where DDP puts it
            assert torch.equal(found[hook][0], found["ddp"]), hook
        for hook in ("power_sgd", "power_sgd_single_round"):  # and wherever its matrix spreads it
            assert not found[hook][0][~found["ddp"]].any(), hook
        for hook in ("power_sgd", "power_sgd_single_round", "repaired"):
            assert found[hook][1], f"{hook} changed its error memory on a non-finite step"


def test_step_count_follows_modules_that_join_later(two):
    for r in two:
        assert r["late_module"] == [1, 2, 3, 4]


def test_a_module_sitting_out_the_steps_after_a_load_keeps_its_memories(two):
    # Under FSDP2 a module left out of the forward pass calls no hook: its loaded memories
    # meet nothing for a while and are kept, where DDP's would be dropped after a step. And the
    # parameters are numbered module by module when the hook is registered: numbered as the
    # modules first called the hook, the trunk took the head's numbers, and every memory
    # met a parameter of another shape and was reset, with a warning each.
    for r in two:
        messages, keys = r["sat_out"]
        assert not messages, messages
        assert all(saved and saved == kept for saved, kept in keys), keys


def test_partial_gradient_sync_is_refused_with_the_fix(two):
    for r in two:
        assert "twice before" in r["partial_sync"], r["partial_sync"]
        assert "set_requires_gradient_sync" in r["partial_sync"]


def test_where_fsdp_reads_the_shard_at_once_the_hook_has_averaged_it(two):
    for r in two:
        seen, ours, ddp = r["read_at_once"]
        # Per pass: what the post-accumulate-grad hook saw, then DDP's gradient so far.
        assert len(seen) == 4
        assert relative(seen[0], seen[1]) <= 1e-5
        assert relative(seen[2], seen[3]) <= 1e-5
        assert relative(ours, ddp) <= 1e-5


def gated_backward(rank: int, world_size: int, store_path: str) -> dict:
    """Rank 1 starts its second backward pass only once rank 0 has reached its first layer's
    gradient in its own: rank 0 gets there only if each hook call returned without waiting for
    rank 1's collectives. The results must not depend on that timing."""
    store = dist.FileStore(store_path, world_size)
    store.set_timeout(datetime.timedelta(seconds=30))
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    out = {}
    for hook, gated in (("allreduce", True), ("power_sgd", True), ("power_sgd", False)):
        model = shard(make_net(), mesh["shard"])
        commhooks.fsdp.register(model, hook, mesh=mesh, **(FAST if hook != "allreduce" else {}))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step, (x, y) in enumerate(data(rank, steps=2)):
            if step == 1 and gated:  # the first pass also sets up groups and compares options
                gate(model, rank, store, key=f"{hook}: rank 0 reached the first layer")
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        out[(hook, gated)] = full(model)
    ddp = DDP(make_net(), find_unused_parameters=True)
    train(ddp, data(rank, steps=2))
    out["ddp"] = full(ddp.module)
    return out


def gate(model: nn.Module, rank: int, store, key: str) -> None:
    """On rank 0, set ``key`` when the backward pass reaches the first layer's output; on rank
    1, wait for it before the backward pass goes past the last layer's output."""

    def on_output(_module, _inputs, output: torch.Tensor) -> None:
        if rank == 0:
            output.register_hook(lambda _grad: store.set(key, "1"))
        else:
            output.register_hook(lambda _grad: store.wait([key]))

    layer = model[0] if rank == 0 else model[len(model) - 1]
    layer.register_forward_hook(on_output)


@pytest.mark.timeout(150)
def test_each_module_communicates_while_the_backward_pass_goes_on(tmp_path):
    results = run_on_ranks(gated_backward, 2, str(tmp_path / "store"), pg_timeout=20, timeout=120)
    for r in results:
        assert relative(r[("allreduce", True)], r["ddp"]) <= 1e-5
        assert torch.equal(r[("power_sgd", True)], r[("power_sgd", False)])
        assert torch.equal(r[("power_sgd", True)], results[0][("power_sgd", True)])


def stopped_peer(rank: int, world_size: int) -> str:
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    model = shard(make_net(), mesh["shard"])
    commhooks.fsdp.register(model, "power_sgd", mesh=mesh, **FAST)
    for step, (x, y) in enumerate(data(rank)):
        if step == 2 and rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)  # the other machine stops answering
        nn.functional.mse_loss(model(x), y).backward()
    return "finished"


@pytest.mark.timeout(150)
def test_a_stopped_machine_raises_after_the_group_timeout_not_a_hang():
    with pytest.raises(RankError) as error:
        run_on_ranks(stopped_peer, 2, pg_timeout=5, timeout=120)
    message = str(error.value)
    assert "rank 0 raised" in message and "Timed out" in message, message[-2000:]
