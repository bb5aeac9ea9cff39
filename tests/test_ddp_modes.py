"""Every hook under the ways DDP is really used (gloo, 2 ranks).

Each test runs every hook that communicates (allreduce, fp16, bf16, the three PowerSGD
variants and post-local SGD) through ``commhooks.register`` and checks that training stays
finite and the replicas stay identical; for the allreduce hook, it also checks bitwise equality
with DDP without a hook. The quantized hooks run the same ways on 4 ranks as 2 machines of 2,
where they take two hops.
"""

import contextlib
import os

import pytest
import torch
import torch.distributed as dist
from ddp_utils import IN, OUT, batches, flat_params, make_mlp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks
from commhooks import comm
from commhooks.testing import run_on_ranks

# Options that make the stateful hooks switch to their compressed / local mode within the test.
HOOKS = {
    "allreduce": {},
    "fp16": {},
    "power_sgd": {"matrix_approximation_rank": 2, "start_powerSGD_iter": 2},
    "post_local_sgd": {"start_localSGD_iter": 2},
    "bf16": {},
    "batched_power_sgd": {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2},
    "power_sgd_single_round": {"matrix_approximation_rank": 2, "start_powerSGD_iter": 2},
}
NAMES = list(HOOKS)
TWO_HOPS = {"int8": {}, "int4": {"packed": True}}  # on 2 machines of 2 ranks


def _ddp(model, name, **ddp_kwargs):
    ddp = DDP(model, bucket_cap_mb=0.004, **ddp_kwargs)
    state = commhooks.register(ddp, name, **{**HOOKS, **TWO_HOPS}[name]) if name else None
    return ddp, state


def _step(ddp, opt, x, y):
    opt.zero_grad(set_to_none=True)
    nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()


def _assert_synced_and_finite(results, name, plain_key="plain"):
    first = results[0]["params"]
    assert torch.isfinite(first).all(), f"{name}: non-finite parameters"
    for r in results[1:]:
        assert torch.equal(r["params"], first), f"{name}: replicas diverged"
    if name == "allreduce" and plain_key in results[0]:
        assert torch.equal(first, results[0][plain_key]), "allreduce differs from plain DDP"


# -- gradient accumulation ---------------------------------------------------------------------
def _accumulate(rank, world_size, name):
    out = {}
    for key, hook_name in (("params", name), ("plain", None)):
        ddp, state = _ddp(make_mlp(), hook_name)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        data = batches(rank, 12)
        for step in range(4):
            opt.zero_grad(set_to_none=True)
            for micro, (x, y) in enumerate(data[3 * step : 3 * step + 3]):
                last = micro == 2
                ctx = ddp.no_sync() if not last else contextlib.nullcontext()
                with ctx:
                    nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        out[key] = flat_params(ddp.module)
        if hook_name and hasattr(state, "iter"):
            out["iter"] = state.iter
    return out


@pytest.mark.parametrize("name", NAMES)
def test_no_sync_gradient_accumulation(name):
    results = run_on_ranks(_accumulate, 2, name)
    _assert_synced_and_finite(results, name)
    if "iter" in results[0]:
        # 4 optimizer steps of 3 micro-batches each: counters count optimizer steps.
        assert results[0]["iter"] == 4


def _count_hook_calls(rank, world_size):
    from ddp_utils import count_buckets

    hook, seen = count_buckets(commhooks.allreduce_hook)
    calls = []

    def counting(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        calls.append(bucket.index())
        return hook(state, bucket)

    ddp = DDP(make_mlp(), bucket_cap_mb=0.004)
    ddp.register_comm_hook(None, counting)
    data = batches(rank, 6)
    per_step = []
    for step in range(2):
        for micro, (x, y) in enumerate(data[3 * step : 3 * step + 3]):
            before = len(calls)
            with ddp.no_sync() if micro < 2 else contextlib.nullcontext():
                nn.functional.mse_loss(ddp(x), y).backward()
            per_step.append(len(calls) - before)
    return per_step


def test_hooks_run_only_on_synchronising_backward():
    for per_step in run_on_ranks(_count_hook_calls, 2):
        assert per_step[0] == per_step[1] == per_step[3] == per_step[4] == 0
        assert per_step[2] > 0 and per_step[5] > 0


# -- DDP constructor flags ---------------------------------------------------------------------
def _with_flags(rank, world_size, name, flags):
    out = {}
    for key, hook_name in (("params", name), ("plain", None)):
        ddp, _ = _ddp(make_mlp(), hook_name, **flags)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        for x, y in batches(rank, 6):
            _step(ddp, opt, x, y)
        out[key] = flat_params(ddp.module)
    return out


@pytest.mark.parametrize("flags", ["gradient_as_bucket_view", "static_graph"])
@pytest.mark.parametrize("name", NAMES)
def test_ddp_flags(name, flags):
    _assert_synced_and_finite(run_on_ranks(_with_flags, 2, name, {flags: True}), name)


class Branchy(nn.Module):
    """A model whose second head is used only on even steps."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(IN, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head_a = nn.Linear(64, OUT)
        self.head_b = nn.Linear(64, OUT)

    def forward(self, x, use_b):
        h = self.body(x)
        return self.head_a(h) + (self.head_b(h) if use_b else 0)


def _unused_and_frozen(rank, world_size, name):
    out = {}
    for key, hook_name in (("params", name), ("plain", None)):
        ddp, _ = _ddp(Branchy(), hook_name, find_unused_parameters=True)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        for step, (x, y) in enumerate(batches(rank, 8)):
            if step == 4:  # freeze the first layer mid-training
                for p in ddp.module.body[0].parameters():
                    p.requires_grad_(False)
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(ddp(x, use_b=step % 2 == 0), y).backward()
            opt.step()
        out[key] = flat_params(ddp.module)
    return out


@pytest.mark.parametrize("name", NAMES)
def test_unused_branch_and_frozen_parameters(name):
    _assert_synced_and_finite(run_on_ranks(_unused_and_frozen, 2, name), name)


# -- uneven inputs -----------------------------------------------------------------------------
def _uneven(rank, world_size, name):
    ddp, state = _ddp(make_mlp(), name)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    with ddp.join():
        for x, y in batches(rank, 4 + 3 * rank):  # rank 1 has 3 more batches
            _step(ddp, opt, x, y)
    return {"params": flat_params(ddp.module)}


@pytest.mark.parametrize("name", NAMES)
def test_uneven_inputs_with_join(name):
    _assert_synced_and_finite(run_on_ranks(_uneven, 2, name, timeout=90), name)


# -- mixed precision ---------------------------------------------------------------------------
def _autocast_bf16(rank, world_size, name):
    ddp, _ = _ddp(make_mlp(), name)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for x, y in batches(rank, 6):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.mse_loss(ddp(x).float(), y)
        loss.backward()
        opt.step()
    return {"params": flat_params(ddp.module)}


@pytest.mark.parametrize("name", NAMES)
def test_autocast_bf16(name):
    _assert_synced_and_finite(run_on_ranks(_autocast_bf16, 2, name), name)


def _grad_scaler_skip(rank, world_size, name):
    ddp, state = _ddp(make_mlp(), name)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    skipped = 0
    for step, (x, y) in enumerate(batches(rank, 8)):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(ddp(x), y)
        if step == 4:  # one step of overflowing gradients, on one rank only
            loss = loss * (float("inf") if rank == 0 else 1.0)
        scale_before = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < scale_before
    memory = []
    for value in getattr(state, "state_dict", dict)().values():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            memory.append(value)
        elif isinstance(value, dict):
            memory += [v for v in value.values() if isinstance(v, torch.Tensor)]
    return {
        "params": flat_params(ddp.module),
        "skipped": skipped,
        "memory_finite": all(torch.isfinite(t).all() for t in memory if t.is_floating_point()),
    }


@pytest.mark.parametrize("name", NAMES)
def test_grad_scaler_skipped_step_does_not_poison_state(name):
    results = run_on_ranks(_grad_scaler_skip, 2, name)
    _assert_synced_and_finite(results, name)
    assert all(r["skipped"] == 1 for r in results), "the scaler skipped exactly one step"
    assert all(r["memory_finite"] for r in results)


# -- two dtypes --------------------------------------------------------------------------------
class TwoDtypes(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(IN, 64)
        self.b = nn.Linear(64, OUT).double()

    def forward(self, x):
        return self.b(torch.relu(self.a(x)).double()).float()


def _two_dtypes(rank, world_size, name):
    out = {}
    for key, hook_name in (("params", name), ("plain", None)):
        ddp, _ = _ddp(TwoDtypes(), hook_name)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        for x, y in batches(rank, 5):
            _step(ddp, opt, x, y)
        out[key] = torch.cat([p.detach().double().reshape(-1) for p in ddp.parameters()])
    return out


@pytest.mark.parametrize("name", NAMES)
def test_parameters_of_two_dtypes(name):
    _assert_synced_and_finite(run_on_ranks(_two_dtypes, 2, name), name)


# -- failures ----------------------------------------------------------------------------------
def _raising_hook_on_rank1(rank, world_size):
    def hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        fut = commhooks.fp16_compress_hook(state, bucket)
        if rank == 1 and bucket.index() == 0:
            return fut.then(lambda f: (_ for _ in ()).throw(RuntimeError("decompression failed")))
        return fut

    ddp = DDP(make_mlp(), bucket_cap_mb=0.004)
    ddp.register_comm_hook(None, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    try:
        for x, y in batches(rank, 4):
            _step(ddp, opt, x, y)
    except Exception as exc:  # every rank must get here, none may hang
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_error_in_async_work_surfaces_on_every_rank():
    errors = run_on_ranks(_raising_hook_on_rank1, 2, timeout=90, pg_timeout=10)
    assert "decompression failed" in errors[1]
    assert errors[0] != "no error"


# -- the quantized hooks' two hops -------------------------------------------------------------
def _two_machines(rank: int) -> None:
    os.environ[comm.topology.MACHINE_ID_VAR] = f"machine{rank // 2}"


MODES = {
    "no_sync": (_accumulate, ()),
    "gradient_as_bucket_view": (_with_flags, ({"gradient_as_bucket_view": True},)),
    "static_graph": (_with_flags, ({"static_graph": True},)),
    "unused_and_frozen": (_unused_and_frozen, ()),
    "join": (_uneven, ()),
    "autocast": (_autocast_bf16, ()),
    "two_dtypes": (_two_dtypes, ()),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_two_hops_under_every_way_ddp_is_used(mode):
    run, extra = MODES[mode]
    for name in TWO_HOPS:
        results = run_on_ranks(run, 4, name, *extra, prepare=_two_machines, timeout=90)
        _assert_synced_and_finite(results, name)
