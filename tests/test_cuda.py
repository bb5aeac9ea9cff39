"""Every hook on CUDA tensors: NCCL with one GPU per rank, and gloo with ranks sharing a GPU.

Skipped where torch sees no GPU (CI has none); the CPU suite checks the same properties on
gloo. On a machine with one GPU, NCCL runs one rank (NCCL refuses two ranks on one device)
and gloo runs two ranks on that GPU, which exercises the multi-rank paths on CUDA tensors:
``python -m pytest tests/test_cuda.py``. A race between CUDA streams may pass a quiet run and
fail under load: with pytest-xdist, ``python -m pytest -n 12 tests/test_cuda.py`` runs the tests
with other ranks competing for the GPU and the host. (Run twelve at a time, 14 of 36 repetitions
of the gloo PowerSGD tests failed while PyTorch's allocator could reuse a tensor that a
callback's stream still read; none since.)
"""

import importlib.util
import io
import os

import pytest
import torch
import torch.distributed as dist
from ddp_utils import IN, OUT, FakeBucket, make_mlp, streaming_diloco
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_default
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks
from commhooks import comm
from commhooks.compress import blocks as quantize
from commhooks.testing import run_on_ranks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEPS = 8
ONE_BUCKET = 100.0  # bucket_cap_mb: the whole model in one bucket
SMALL_BUCKETS = 0.004  # several buckets for the small MLP


def _device(rank: int) -> torch.device:
    if not torch.cuda.is_available():  # the rank functions also run on CPU, for their own checks
        return torch.device("cpu")
    index = rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _data(rank: int, device: torch.device, steps: int = STEPS) -> list:
    gen = torch.Generator().manual_seed(100 + rank)
    return [
        (
            torch.randn(16, IN, generator=gen).to(device),
            torch.randn(16, OUT, generator=gen).to(device),
        )
        for _ in range(steps)
    ]


def _ddp(
    device,
    hook=None,
    state=None,
    bucket_cap_mb=SMALL_BUCKETS,
    widths=None,
    register=None,
    dtype=torch.float32,
):
    model = (make_mlp(widths=widths) if widths else make_mlp()).to(device, dtype)
    ids = [device.index] if device.type == "cuda" else None
    ddp = DDP(model, device_ids=ids, bucket_cap_mb=bucket_cap_mb)
    if register is not None:
        state = commhooks.register(ddp, register)
    elif hook is not None:
        ddp.register_comm_hook(state, hook)
    return ddp, state


def _grads(ddp: nn.Module, data: list, lr: float = 0.05) -> torch.Tensor:
    """The averaged gradient of every step, on the CPU, as one row per step."""
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    rows = []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ddp(x), y).backward()
        grads = [getattr(p.grad, "to_local", lambda g=p.grad: g)() for p in ddp.parameters()]
        rows.append(torch.cat([g.reshape(-1) for g in grads]).cpu())  # FSDP2: this rank's shard
        opt.step()
    return torch.stack(rows)


def _params(ddp: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]).cpu()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).norm(dim=1) / b.norm(dim=1).clamp_min(1e-30)).max())


def test_futures_make_the_consumer_wait_for_the_stream_that_produced_the_result():
    # A follow-up runs on whatever stream its thread has; DDP reads the result on its own.
    # If the futures do not carry the stream order, the read below sees the zeros.
    issuer = comm.OrderedIssuer()
    tensor = torch.zeros(1 << 20, device="cuda")
    assert comm.future_devices([torch.ones(1), tensor]) == [tensor.device]

    def slow_fill(value: torch.Tensor) -> torch.futures.Future:
        torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU clock cycles on the current stream
        return comm.completed(value.fill_(1.0))

    with torch.cuda.stream(torch.cuda.Stream()):
        out = issuer.then(comm.completed(tensor), slow_fill, comm.future_devices(tensor))
    assert bool((out.wait() == 1.0).all())


# ----------------------------------------------------------------------------------------------
# Rank functions (module level, so the rank processes can import them)
# ----------------------------------------------------------------------------------------------
def _default_hooks_against_plain_ddp_and_pytorch(rank: int, world_size: int) -> dict:
    device = _device(rank)
    data = _data(rank, device)
    plain = _grads(_ddp(device)[0], data)
    out = {"device": str(device), "plain": plain}
    ours = {
        "allreduce": commhooks.allreduce_hook,
        "fp16": commhooks.fp16_compress_hook,
        "bf16": commhooks.bf16_compress_hook,
        "fp16_wrapper": commhooks.fp16_compress_wrapper(commhooks.allreduce_hook),
        "bf16_wrapper": commhooks.bf16_compress_wrapper(commhooks.allreduce_hook),
        "noop": commhooks.noop_hook,
    }
    for name, hook in ours.items():
        out[name] = _grads(_ddp(device, hook)[0], data)
    theirs = {
        "fp16": torch_default.fp16_compress_hook,
        "fp16_wrapper": torch_default.fp16_compress_wrapper(torch_default.allreduce_hook),
    }
    if device.type == "cuda":  # PyTorch refuses its bf16 hooks without CUDA
        theirs["bf16"] = torch_default.bf16_compress_hook
        theirs["bf16_wrapper"] = torch_default.bf16_compress_wrapper(torch_default.allreduce_hook)
    for name, hook in theirs.items():
        out[f"torch_{name}"] = _grads(_ddp(device, hook)[0], data)
    # A local model without DDP: what the no-op hook must hand back.
    local = make_mlp().to(device)
    out["local"] = _grads(local, data)
    # By name, as users configure it: bf16 must be accepted on this backend.
    out["registered_bf16"] = _grads(_ddp(device, register="bf16")[0], data)
    return out


# One GPU per NCCL rank; PyTorch's default backend with CUDA pairs gloo for CPU tensors.
NCCL_BACKENDS = ["nccl", "cpu:gloo,cuda:nccl"]


def _nccl_world() -> int:
    return min(2, torch.cuda.device_count())


@pytest.mark.parametrize("backend", NCCL_BACKENDS)
def test_default_hooks_on_nccl(backend):
    world = _nccl_world()
    for r in run_on_ranks(_default_hooks_against_plain_ddp_and_pytorch, world, backend=backend):
        _check_default_hooks(r)


def test_default_hooks_on_cuda_tensors_with_gloo():
    for r in run_on_ranks(_default_hooks_against_plain_ddp_and_pytorch, 2, backend="gloo"):
        _check_default_hooks(r)


def _check_default_hooks(r: dict) -> None:
    assert r["device"].startswith("cuda")
    assert torch.equal(r["allreduce"], r["plain"])
    for name in ("fp16", "bf16", "fp16_wrapper", "bf16_wrapper"):
        assert torch.equal(r[name], r[f"torch_{name}"]), name
        assert not torch.equal(r[name], r["plain"]), f"{name} did not reduce the precision"
    assert torch.equal(r["registered_bf16"], r["bf16"])
    assert torch.equal(r["noop"], r["local"])


# Per bucket, this rank's values: plain; a rank's cast overflows (on two ranks the average
# fits); the average is beyond float16; a NaN with an overflowing value beside it.
def _half_buckets(rank: int) -> list[list[float]]:
    return [
        [1.0 + rank, -2.5, 0.25],
        [7e4 if rank == 0 else 0.0, 0.5, 1.0],
        [7e4, 1.0 + 2 * rank, 3.0],
        [float("nan") if rank == 0 else 1.0, 1.0, 7e4 if rank == 0 else 0.0],
    ]


def _half_hooks_without_a_sync(rank: int, world_size: int) -> dict:
    """Every bucket under CUDA's sync debug mode "error": nothing may make the host wait for
    the device, the step's last bucket included. The results must equal the same hooks' on
    CPU tensors."""
    device = _device(rank)
    cpu_group = dist.new_group(backend="gloo")
    hooks = {
        "fp16": commhooks.fp16_compress_hook,
        "bf16": commhooks.bf16_compress_hook,
        "fp16_wrapper": commhooks.fp16_compress_wrapper(commhooks.allreduce_hook),
    }
    out = {}
    for name, hook in hooks.items():
        hook(None, FakeBucket([torch.ones(4)], last=True, device=device)).wait()  # set-up
        values = _half_buckets(rank)
        buckets = [
            FakeBucket([torch.tensor(v)], i, last=i == len(values) - 1, device=device)
            for i, v in enumerate(values)
        ]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            futures = [hook(None, b) for b in buckets]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        on_gpu = [f.wait().cpu() for f in futures]
        on_cpu = [
            hook(cpu_group, FakeBucket([torch.tensor(v)], i)).wait() for i, v in enumerate(values)
        ]
        out[name] = (on_gpu, on_cpu)
    return out


def test_half_precision_hooks_never_wait_for_the_device_and_give_the_cpus_results():
    world = _nccl_world()
    for result in run_on_ranks(_half_hooks_without_a_sync, world, backend="nccl"):
        for name, (on_gpu, on_cpu) in result.items():
            for gpu, cpu in zip(on_gpu, on_cpu):
                assert torch.equal(gpu.isnan(), cpu.isnan()), (name, gpu, cpu)
                assert torch.equal(gpu.nan_to_num(), cpu.nan_to_num()), (name, gpu, cpu)


def _powersgd_against_pytorch(rank: int, world_size: int) -> list:
    device = _device(rank)
    out = []
    for options in (
        dict(matrix_approximation_rank=1),
        dict(matrix_approximation_rank=1, warm_start=False),
        dict(matrix_approximation_rank=3),  # QR
        dict(matrix_approximation_rank=3, warm_start=False),
    ):
        # Above rank 1 the products are formed on another layout of the factors, rounded
        # otherwise, and warm start carries rounding from step to step: compared in float64.
        wide = options["matrix_approximation_rank"] > 1
        dtype, tolerance = (torch.float64, 1e-9) if wide else (torch.float32, 1e-5)
        data = [(x.to(dtype), y.to(dtype)) for x, y in _data(rank, device, 20)]
        ours = commhooks.PowerSGDState(None, start_powerSGD_iter=2, **options)
        theirs = torch_powersgd.PowerSGDState(None, start_powerSGD_iter=2, **options)
        hooks = commhooks.powerSGD_hook, torch_powersgd.powerSGD_hook
        a = _grads(_ddp(device, hooks[0], ours, ONE_BUCKET, dtype=dtype)[0], data)
        b = _grads(_ddp(device, hooks[1], theirs, ONE_BUCKET, dtype=dtype)[0], data)
        out.append((options, _relative(a, b), tolerance, ours.compression_stats()[0]))
    return out


def test_powersgd_matches_pytorch_on_nccl():
    for per_rank in run_on_ranks(_powersgd_against_pytorch, _nccl_world(), backend="nccl"):
        for options, relative, tolerance, rate in per_rank:
            assert relative <= tolerance, (options, relative)
            assert rate > 1.5, options


def test_powersgd_matches_pytorch_on_cuda_tensors_with_gloo():
    for per_rank in run_on_ranks(_powersgd_against_pytorch, 2, backend="gloo"):
        for options, relative, tolerance, rate in per_rank:
            assert relative <= tolerance, (options, relative)
            assert rate > 1.5, options


def _stateful_hooks_on_many_buckets(rank: int, world_size: int) -> dict:
    """Every stateful hook on several buckets: replicas must stay identical and finite."""
    device = _device(rank)
    data = _data(rank, device, 30)
    out = {}
    variants = {
        "power_sgd": (commhooks.powerSGD_hook, dict(matrix_approximation_rank=2)),
        "power_sgd_batched_shapes": (
            commhooks.powerSGD_hook,
            dict(matrix_approximation_rank=2, batch_tensors_with_same_shape=True),
        ),
        "single_round": (commhooks.powerSGD_hook, dict(single_round=True)),
        "batched": (commhooks.batched_powerSGD_hook, dict(matrix_approximation_rank=1)),
        "fp16_power_sgd": (
            commhooks.fp16_compress_wrapper(commhooks.powerSGD_hook),
            dict(matrix_approximation_rank=2),
        ),
    }
    widths = (IN, 48, 48, 48, OUT)  # same-shaped layers, batched together when asked to
    for name, (hook, options) in variants.items():
        state = commhooks.PowerSGDState(None, start_powerSGD_iter=1, **options)
        ddp, _ = _ddp(device, hook, state, widths=widths)
        grads = _grads(ddp, data)
        out[name] = (_params(ddp), bool(torch.isfinite(grads).all()), state.compression_stats())
    return out


@pytest.mark.parametrize("backend", [*NCCL_BACKENDS, "gloo"])
def test_stateful_hooks_on_many_buckets_keep_replicas_identical(backend):
    world = 2 if backend == "gloo" else _nccl_world()
    results = run_on_ranks(_stateful_hooks_on_many_buckets, world, backend=backend)
    for name in results[0]:
        for params, finite, stats in (r[name] for r in results):
            assert finite, name
            assert stats[0] > 1.0, (name, stats)
            assert torch.equal(params, results[0][name][0]), name


def _full_rank_equals_allreduce(rank: int, world_size: int) -> dict:
    device = _device(rank)
    data = _data(rank, device)
    plain = _grads(_ddp(device)[0], data)
    out = {}
    for name, hook, rank_ in (
        ("power_sgd", commhooks.powerSGD_hook, 64),
        ("batched", commhooks.batched_powerSGD_hook, 200),
    ):
        state = commhooks.PowerSGDState(
            None, matrix_approximation_rank=rank_, start_powerSGD_iter=0
        )
        # Below 1 only here, so that full-rank factors (larger than the matrix) are really used.
        object.__setattr__(state.settings, "min_compression_rate", 0.5)
        grads = _grads(_ddp(device, hook, state, ONE_BUCKET)[0], data)
        out[name] = (_relative(grads, plain), len(state.q_memory_dict))
    return out


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_powersgd_at_full_rank_equals_allreduce(backend):
    world = 2 if backend == "gloo" else _nccl_world()
    for r in run_on_ranks(_full_rank_equals_allreduce, world, backend=backend):
        assert r["power_sgd"][0] <= 1e-4 and r["power_sgd"][1] >= 4, r  # every weight matrix
        assert r["batched"][0] <= 1e-4 and r["batched"][1] == 1, r


def _fake_bucket_checks(rank: int, world_size: int) -> dict:
    # The CPU suite's checks on chosen tensors, with the bucket on this rank's GPU.
    from test_powersgd import _error_feedback, _non_finite, _zero_layer, _zero_then_learn

    device = _device(rank)
    return {
        "zero": _zero_layer(rank, world_size, True, device),
        "zero-then-learn": [
            _zero_then_learn(rank, world_size, r, single, device)
            for r, single in ((1, False), (3, False), (2, True))
        ],
        "error-feedback": [_error_feedback(rank, world_size, s, device) for s in (False, True)],
        "non-finite": [_non_finite(rank, world_size, s, device) for s in (False, True)],
    }


@pytest.fixture(scope="module")
def fake_bucket_results():
    return run_on_ranks(_fake_bucket_checks, 2, backend="gloo")


def test_zero_gradient_comes_back_as_zeros_and_learns_again(fake_bucket_results):
    for r in fake_bucket_results:
        zero, other = r["zero"]
        assert torch.equal(zero, torch.zeros_like(zero))
        assert bool(torch.isfinite(other).all()) and bool(other.abs().sum() > 0)
        for sizes in r["zero-then-learn"]:
            assert sizes[0] == 0.0 and all(x > 0 for x in sizes[1:]), sizes


def test_error_feedback_identity(fake_bucket_results):
    for r in fake_bucket_results:
        assert r["error-feedback"] == [4 * 3, 4 * 3]


def test_non_finite_gradient_keeps_error_memory_and_factors(fake_bucket_results):
    for rank, r in enumerate(fake_bucket_results):
        for single, (finite, unchanged, out, exact, drift) in enumerate(r["non-finite"]):
            assert not finite and unchanged, (single, rank)
            assert exact or (single and drift < 1e-6), (single, rank, drift)
            assert torch.isinf(out[3]) and torch.isfinite(torch.cat([out[:3], out[4:]])).all()


def _resume(rank: int, world_size: int, single_round: bool) -> tuple:
    """Train 8 steps, saving after 4; restore that save into fresh objects and train the last 4."""
    device = _device(rank)
    data = _data(rank, device)
    options = dict(matrix_approximation_rank=2, start_powerSGD_iter=1, single_round=single_round)
    state = commhooks.PowerSGDState(None, **options)
    ddp, _ = _ddp(device, commhooks.powerSGD_hook, state)
    first = _grads(ddp, data[:4])
    buf = io.BytesIO()
    torch.save({"model": ddp.module.state_dict(), "hook": state.state_dict()}, buf)
    uninterrupted = _grads(ddp, data[4:])

    buf.seek(0)
    saved = torch.load(buf, weights_only=True, map_location="cpu")
    model = make_mlp(seed=123).to(device)  # everything must come from the file
    model.load_state_dict(saved["model"])
    restored = commhooks.PowerSGDState(None, **options)
    restored.load_state_dict(saved["hook"])
    ids = [device.index] if device.type == "cuda" else None
    ddp = DDP(model, device_ids=ids, bucket_cap_mb=SMALL_BUCKETS)
    ddp.register_comm_hook(restored, commhooks.powerSGD_hook)
    return bool(first.abs().sum() > 0), uninterrupted, _grads(ddp, data[4:])


@pytest.mark.parametrize("single_round", [False, True])
def test_powersgd_resumes_exactly_from_a_cpu_checkpoint(single_round):
    for trained, uninterrupted, resumed in run_on_ranks(_resume, 2, single_round, backend="gloo"):
        assert trained
        assert torch.equal(uninterrupted, resumed)


def _post_local_sgd(rank: int, world_size: int) -> list:
    device = _device(rank)
    state = commhooks.PostLocalSGDState(None, None, start_localSGD_iter=3)
    ddp, _ = _ddp(device, commhooks.post_localSGD_hook, state)
    opt = commhooks.PostLocalSGDOptimizer(
        torch.optim.SGD(ddp.parameters(), lr=0.05),
        commhooks.PeriodicModelAverager(period=2, warmup_steps=3),
    )
    return _params_each_step(ddp, opt, _data(rank, device))


def _params_each_step(ddp: nn.Module, opt: torch.optim.Optimizer, data: list) -> list:
    """The parameters after each step of training on ``data``, on the CPU."""
    params = []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        params.append(_params(ddp))
    return params


def test_post_local_sgd_and_averaging_on_cuda_tensors():
    # Each rank its own machine: gradients are averaged for the first 3 steps only; the
    # parameters are averaged after the steps whose 0-based index is 3, 5, 7.
    a, b = run_on_ranks(_post_local_sgd, 2, backend="gloo", env={"LOCAL_WORLD_SIZE": "1"})
    for index, (pa, pb) in enumerate(zip(a, b)):
        averaged = index < 3 or (index - 3) % 2 == 0
        assert torch.equal(pa, pb) == averaged, index


def _quantized_on_cuda(rank: int, world_size: int) -> dict:
    device = _device(rank)
    data = _data(rank, device)
    plain = _grads(_ddp(device)[0], data)
    out = {"device": str(device)}
    for name in ("int8", "int4"):
        ddp, state = _ddp(device, register=name)
        grads = _grads(ddp, data)
        out[name] = (_relative(grads, plain), _params(ddp), bool(torch.isfinite(grads).all()))
        # The state travels through a CPU checkpoint and loads back on the device.
        buffer = io.BytesIO()
        torch.save(state.state_dict(), buffer)
        buffer.seek(0)
        state.load_state_dict(torch.load(buffer, weights_only=True))
    return out


@pytest.mark.parametrize("backend", [*NCCL_BACKENDS, "gloo"])
def test_quantized_hooks_on_cuda_tensors(backend):
    world = 2 if backend == "gloo" else _nccl_world()
    results = run_on_ranks(_quantized_on_cuda, world, backend=backend)
    # On the CPU the same run gives 0.05 and 0.6; a sum not divided by the world size gives 1.
    for name, bound in (("int8", 0.1), ("int4", 0.9)):
        for r in results:
            assert r["device"].startswith("cuda")
            error, params, finite = r[name]
            assert finite, name
            assert error < bound, (name, error)  # the quantized average tracks allreduce's
            assert torch.equal(params, results[0][name][1]), name  # replicas identical


def _machine_of_two(rank: int) -> None:
    """Ranks 0 and 1 share machine 0, ranks 2 and 3 machine 1 (``COMMHOOKS_MACHINE_ID``)."""
    os.environ[comm.topology.MACHINE_ID_VAR] = f"machine{rank // 2}"


def _int8_both_paths_on_cuda(rank: int, world_size: int) -> dict:
    """int8 on CUDA tensors, the path ``topology`` picks and the flat one: whether it took two
    hops, and the parameters after eight steps (on the CPU)."""
    device = _device(rank)
    out = {}
    for topology in ("auto", "flat"):
        ddp, _ = _ddp(device)
        state = commhooks.register(ddp, "int8", topology=topology)
        _params_each_step(ddp, torch.optim.SGD(ddp.parameters(), lr=0.05), _data(rank, device))
        params = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]).cpu()
        out[topology] = (state.hops is not None, params)
    return out


def test_two_gloo_ranks_sharing_a_gpu_are_one_machine_and_take_the_flat_path():
    # One machine: nothing crosses a slow link, so the flat path, bitwise as topology='flat'.
    results = run_on_ranks(
        _int8_both_paths_on_cuda, 2, backend="gloo", env={"LOCAL_WORLD_SIZE": "2"}
    )
    for r in results:
        (two_hops, params), (_, flat) = r["auto"], r["flat"]
        assert not two_hops and torch.equal(params, flat)
        assert torch.equal(params, results[0]["auto"][1])


def test_two_machines_of_two_gloo_ranks_on_a_gpu_take_two_hops_and_agree():
    results = run_on_ranks(_int8_both_paths_on_cuda, 4, backend="gloo", prepare=_machine_of_two)
    for r in results:
        (two_hops, params), (flat_hops, flat) = r["auto"], r["flat"]
        assert two_hops and not flat_hops
        assert torch.equal(params, results[0]["auto"][1])  # replicas identical on either path
        assert torch.equal(flat, results[0]["flat"][1])
        assert (params - flat).abs().max() < 0.05  # both track the same average


def _streaming_diloco_on_cuda(rank: int, world_size: int) -> tuple:
    device = _device(rank)
    ddp, _ = _ddp(device)
    inner, diloco = streaming_diloco(ddp)
    params = _params_each_step(ddp, inner, _data(rank, device))
    diloco.finish()
    assert diloco.snapshot is not None
    snapshot = {n: t.cpu() for n, t in diloco.snapshot.items()}
    # The state travels through a CPU checkpoint and loads back on the device.
    buffer = io.BytesIO()
    torch.save(diloco.state_dict(), buffer)
    buffer.seek(0)
    diloco.load_state_dict(torch.load(buffer, weights_only=True))
    return str(device), params, snapshot


@pytest.mark.parametrize("backend", [*NCCL_BACKENDS, "gloo"])
def test_streaming_diloco_on_cuda_tensors(backend):
    # An int8 warm-up of 2 steps, then int4 fragments applied one step after they are issued.
    world = 2 if backend == "gloo" else _nccl_world()
    results = run_on_ranks(_streaming_diloco_on_cuda, world, backend=backend)
    _, first, global_first = results[0]
    for device, params, snapshot in results:
        assert device.startswith("cuda")
        assert all(torch.isfinite(p).all() for p in params)
        assert all(torch.equal(params[step], first[step]) for step in range(2))  # the warm-up
        assert all(torch.equal(t, global_first[n]) for n, t in snapshot.items())


def _quantized_with_or_without_triton(rank: int, world_size: int, eager: tuple) -> tuple:
    """Three steps of each quantized hook (int8, int4, int4 packed) on a bucket of odd length;
    ranks in ``eager`` run PyTorch's operations instead of the Triton kernels."""
    from commhooks.compress import triton_launch

    if rank in eager:
        os.environ["COMMHOOKS_TRITON"] = "0"  # read when the kernels are first wanted
    device = _device(rank)
    averages, memories = [], []
    for bits, packed in ((8, False), (4, False), (4, True)):  # packed: 13 levels, 30-bit groups
        state = commhooks.QuantizationState(None, bits=bits, block_size=64, packed=packed)
        for step in range(3):
            gen = torch.Generator().manual_seed(100 * rank + step)
            gradient = (torch.randn(5003, generator=gen) * (1 + rank)).to(device)
            averages.append(commhooks.quantized_hook(state, FakeBucket([gradient])).wait().cpu())
        memories.append({k: v.cpu() for k, v in _tensors(state.state_dict())})
    return averages, memories, triton_launch.available()


def _tensors(tree, prefix: str = ""):
    """The tensors of a nested state dict, with their paths."""
    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from _tensors(value, f"{prefix}/{key}")
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            yield from _tensors(value, f"{prefix}/{index}")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_quantized_ranks_with_and_without_triton_stay_in_sync_bitwise():
    mixed = run_on_ranks(_quantized_with_or_without_triton, 2, (1,), backend="gloo")
    fused = run_on_ranks(_quantized_with_or_without_triton, 2, (), backend="gloo")
    assert [m[2] for m in mixed] == [True, False] and fused[1][2]
    for rank in range(2):
        for got, expected in zip(mixed[rank][0], fused[rank][0], strict=True):
            assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
        assert mixed[rank][1][0].keys() == fused[rank][1][0].keys()
        for got, expected in zip(mixed[rank][1], fused[rank][1], strict=True):
            assert all(torch.equal(got[k], expected[k]) for k in got)  # the memories
        for got, first in zip(mixed[rank][0], mixed[0][0], strict=True):
            assert torch.equal(got, first)  # the same average on every rank


def _owners_pass(rows: torch.Tensor, bits: int) -> tuple[torch.Tensor, ...]:
    """The sum of the decoded rows, and the owner's packet and error, on ``rows``' device."""
    fmt = quantize.BlockFormat(bits, 256)
    count, length = rows.shape
    packets = torch.empty(count, fmt.packet_bytes(length), dtype=torch.uint8, device=rows.device)
    quantize.quantize_(rows.clone(), packets, fmt, torch.empty_like(rows))
    summed = quantize.dequantize_sum(
        packets, fmt, torch.empty_like(rows), torch.empty(length, device=rows.device)
    )
    error = torch.empty(1, length, device=rows.device)
    own = torch.empty(1, fmt.packet_bytes(length), dtype=torch.uint8, device=rows.device)
    quantize.requantize_sum_(packets, fmt, error, own, torch.empty_like(rows), count)
    return summed, own, error


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
@pytest.mark.parametrize("bits", [8, 4])
def test_eight_rows_sum_to_the_same_bits_with_and_without_triton(bits):
    from commhooks.compress import triton_launch

    gen = torch.Generator().manual_seed(bits)
    rows = (torch.randn(8, 1 << 16, generator=gen) * torch.logspace(-3, 3, 8)[:, None]).cuda()
    fused = _owners_pass(rows, bits)
    with triton_launch.disabled():
        eager = _owners_pass(rows, bits)
    assert triton_launch.available()
    for got, expected in zip(fused, eager, strict=True):  # the sum, packet and error
        assert torch.equal(got.cpu().view(torch.uint8), expected.cpu().view(torch.uint8))


def _fsdp_on_cuda(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = _device(rank)
    mesh = init_device_mesh("cuda", (world_size, 1), mesh_dim_names=("replicate", "shard"))
    out = {}
    for hook, options in (
        ("allreduce", {}),
        ("fp16", {}),
        ("power_sgd", {"start_powerSGD_iter": 0, "matrix_approximation_rank": 1}),
        ("int8", {}),
    ):
        model = make_mlp().to(device)
        for layer in model:
            if any(True for _ in layer.parameters()):
                fully_shard(layer, mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
        commhooks.fsdp.register(model, hook, mesh=mesh, **options)
        grads = _grads(model, _data(rank, device, steps=3))
        out[hook] = bool(torch.isfinite(grads).all()) and bool(grads.abs().sum() > 0)
    return out


def test_fsdp2_hooks_on_nccl():
    from torch.distributed.fsdp import FSDPModule

    if not hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
        pytest.skip("commhooks.fsdp needs a PyTorch whose FSDPModule has this method (2.13)")
    world = _nccl_world()
    for r in run_on_ranks(_fsdp_on_cuda, world, backend="nccl"):
        assert all(r.values()), r


def test_host_cost_measures_on_one_nccl_rank(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "host.json"
    argv = ["--backend", "nccl", "--layers", "4", "--steps", "2", "--warmup", "3", "--rounds", "1"]
    proc = subprocess.run(
        [sys.executable, str(root / "examples" / "host_cost.py"), *argv,
         "--only", "allreduce,int8,power_sgd", "--json", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["hook"] for r in rows} == {"allreduce", "int8", "power_sgd"}
    assert all(r["ours_ms"] > 0 and r["theirs_ms"] > 0 and r["buckets"] >= 1 for r in rows)
