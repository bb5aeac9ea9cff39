"""The float16 and bfloat16 hooks: PyTorch's semantics (inf where float16 overflows), the
opt-in repair, their memory, and how they fail when a peer dies. gloo, 2-3 ranks."""

import datetime
import multiprocessing
import os
import resource
import signal
import tempfile
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from ddp_utils import FakeBucket, batches, make_ddp, make_mlp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_default

import commhooks
from commhooks import StatelessState
from commhooks.bench import footprint
from commhooks.testing import run_on_ranks

INF = float("inf")


# ----------------------------------------------------------------------------------------------
# PyTorch's semantics by default; the repair when asked
# ----------------------------------------------------------------------------------------------
def _both_ways(rank, world_size, values, hook_name="fp16_compress_hook"):
    """The hook's result on ``values[rank]``, with the defaults and with the repair, the
    repair's warnings, and PyTorch's hook's result."""
    local = torch.tensor(values[rank], dtype=torch.float32)
    hook = getattr(commhooks, hook_name)
    plain = hook(None, FakeBucket([local.clone()])).wait()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        repair = StatelessState(None, on_nonfinite="repair")
        repaired = hook(repair, FakeBucket([local.clone()])).wait()
    theirs = getattr(torch_default, hook_name)(None, FakeBucket([local.clone()])).wait()
    return plain, repaired, [str(w.message) for w in caught], theirs


def _plain_average(values):
    world = len(values)
    return sum(torch.tensor(row) * (1.0 / world) for row in values)


@pytest.mark.parametrize(
    "values",
    [
        [[1e5, 1.0, -2e5], [1e5, 3.0, -2e5]],  # each cast overflows; the average fits
        [[7e4, 0.5], [0.0, 0.5]],  # one rank's cast overflows
        [[7e4, 0.5], [7e4, 0.5]],  # the average itself is beyond float16's range
    ],
    ids=["both-overflow", "one-overflows", "average-beyond-range"],
)
def test_fp16_overflow_gives_inf_as_pytorch_and_the_finite_average_with_repair(values):
    for plain, repaired, messages, theirs in run_on_ranks(_both_ways, 2, values):
        assert torch.equal(plain, theirs) and not torch.isfinite(plain).all()
        assert torch.equal(repaired, _plain_average(values))
        assert len(messages) == 1 and "bucket 0" in messages[0], messages
        assert "on_nonfinite='repair'" in messages[0]


@pytest.mark.parametrize("bad", [float("nan"), INF], ids=["nan", "inf"])
def test_a_non_finite_gradient_stays_non_finite_either_way(bad):
    values = [[bad, 1.0, 2.0], [1.0, 1.0, 0.0]]
    for plain, repaired, _, _ in run_on_ranks(_both_ways, 2, values):
        for out in (plain, repaired):
            assert not out[0].isfinite() and out[0].isnan() == torch.tensor(bad).isnan()
            assert out[1] == 1.0 and out[2] == 1.0


def _abandoned(rank, world_size):
    """With the repair, bucket 0 of a step whose last bucket never came, then the next step's
    buckets 0 and 1 (its last): what each future gives."""
    repair = StatelessState(None, on_nonfinite="repair")
    first = commhooks.fp16_compress_hook(repair, FakeBucket([torch.ones(3)], 0, last=False))
    again = commhooks.fp16_compress_hook(repair, FakeBucket([torch.ones(3) * 2], 0, last=False))
    last = commhooks.fp16_compress_hook(repair, FakeBucket([torch.ones(2) * 3], 1, last=True))
    try:
        first.wait()
        lost = ""
    except RuntimeError as exc:
        lost = str(exc)
    return lost, again.wait(), last.wait()


def test_with_the_repair_a_step_stopped_before_its_last_bucket_fails_its_buckets():
    # A backward pass that raised after bucket 0: the next step's bucket 0 finds it held, fails
    # its future (nothing of it lands anywhere) and the new step is decided at its last bucket.
    for lost, again, last in run_on_ranks(_abandoned, 2):
        assert "abandoned" in lost
        assert torch.equal(again, torch.full((3,), 2.0)) and torch.equal(
            last, torch.full((2,), 3.0)
        )


def _bitwise(rank, world_size):
    torch.manual_seed(rank)
    local = torch.randn(4000) * 10.0 ** torch.randint(-8, 5, (4000,))
    local[1::50] = 9e4 if rank == 1 else 1.0  # beyond float16 on rank 1
    ours = commhooks.fp16_compress_hook(None, FakeBucket([local.clone()])).wait()
    theirs = torch_default.fp16_compress_hook(None, FakeBucket([local.clone()])).wait()
    return ours, theirs


@pytest.mark.parametrize("world_size", [2, 3])
def test_fp16_is_bitwise_pytorchs_everywhere(world_size):
    for ours, theirs in run_on_ranks(_bitwise, world_size):
        assert torch.equal(ours, theirs)
        assert not torch.isfinite(theirs).all()  # inf where float16 overflowed


def _bf16_arithmetic(rank, world_size):
    torch.manual_seed(rank)
    local = torch.randn(5000) * 10.0 ** torch.randint(-30, 30, (5000,))
    ours = commhooks.bf16_compress_hook(None, FakeBucket([local.clone()])).wait()
    low = local.to(torch.bfloat16).div_(world_size)  # PyTorch's bf16 hook, step by step
    dist.all_reduce(low)
    return ours, local.copy_(low)


@pytest.mark.parametrize("world_size", [2, 3])
def test_bf16_is_pytorchs_cast_divide_sum_cast_back(world_size):
    # PyTorch's own bf16 hook refuses to run without CUDA: its arithmetic, step by step.
    for ours, reference in run_on_ranks(_bf16_arithmetic, world_size):
        assert torch.equal(ours, reference)


def _wrapper_both_ways(rank, world_size):
    values = torch.tensor([1e6, -1e6, 1.0, INF, -INF]) if rank == 0 else torch.ones(5)
    hook = commhooks.fp16_compress_wrapper(commhooks.allreduce_hook)
    plain = hook(None, FakeBucket([values.clone()])).wait()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        repair = StatelessState(None, on_nonfinite="repair")
        repaired = hook(repair, FakeBucket([values.clone()])).wait()
    return plain, repaired, len(caught)


def test_the_fp16_wrapper_casts_as_pytorch_and_repairs_when_asked():
    for plain, repaired, warned in run_on_ranks(_wrapper_both_ways, 2):
        # PyTorch's wrapper casts 1e6 to inf, and so does ours: no clipping.
        assert plain.dtype == torch.float16 and torch.isinf(plain[:2]).all()
        assert torch.equal(repaired[:3].float(), torch.tensor([5e5 + 0.5, -5e5 + 0.5, 1.0]))
        assert torch.isposinf(repaired[3]) and torch.isneginf(repaired[4]) and warned == 1


def _float16_bucket_through_the_wrapper(rank, world_size):
    grads = torch.tensor([1.0, INF, -INF, 65504.0, -2.5], dtype=torch.float16)
    hook = commhooks.fp16_compress_wrapper(commhooks.noop_hook)
    return grads, hook(None, FakeBucket([grads.clone()])).wait()


def test_fp16_wrapper_keeps_a_float16_buckets_infinities():
    for grads, out in run_on_ranks(_float16_bucket_through_the_wrapper, 1):
        assert torch.equal(out, grads)


# ----------------------------------------------------------------------------------------------
# Memory: what the hooks allocate per bucket
# ----------------------------------------------------------------------------------------------
ELEMENTS = 1 << 23  # a float32 bucket of 32 MiB: large enough to dwarf everything else


def _status_bytes(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _temporaries(run):
    """(peak resident bytes above the start, bytes of fresh pages written) while ``run`` runs."""
    start = _status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak resident size (VmHWM) to the current one
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    run()
    written = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return _status_bytes("VmHWM") - start, written * os.sysconf("SC_PAGE_SIZE")


MEASURED = {
    "fp16": (commhooks.fp16_compress_hook, torch.float16),
    "bf16": (commhooks.bf16_compress_hook, torch.bfloat16),
    "fp16_wrapper": (commhooks.fp16_compress_wrapper(commhooks.allreduce_hook), torch.float16),
    "bf16_wrapper": (commhooks.bf16_compress_wrapper(commhooks.allreduce_hook), torch.bfloat16),
    "pytorch_fp16": (torch_default.fp16_compress_hook, torch.float16),
}


def _memory_per_bucket(rank, world_size):
    # Every allocation above 64 KiB from pages of its own, returned on free: each temporary a
    # hook writes costs page faults and resident memory, whichever thread allocates it (the
    # hooks' later steps run on gloo's threads), and nothing is reused unseen.
    assert footprint.map_large_allocations_afresh()
    gradient = torch.randn(ELEMENTS, generator=torch.Generator().manual_seed(rank)) * 1e-2
    out = {}
    for name, (hook, _) in MEASURED.items():
        for _ in range(2):  # the first call also sets up the group's follow-up issuer
            bucket = FakeBucket([gradient])
            dist.barrier()
            out[name] = _temporaries(lambda hook=hook, bucket=bucket: hook(None, bucket).wait())
            assert torch.isfinite(bucket.buffer()).all()
    return out


@pytest.mark.timeout(120)
def test_each_bucket_costs_at_most_one_full_size_temporary():
    # PyTorch's fp16 hook writes one full-size float16 copy of the bucket, and gloo a buffer of
    # 2 MiB: an eighth of that copy. A second full-size copy, a float32 one, or even a half
    # one on top of that, fails here, and so does anything that PyTorch's hook does not need.
    for rank, out in enumerate(run_on_ranks(_memory_per_bucket, 2)):
        for name, (peak, written) in out.items():
            copy = ELEMENTS * MEASURED[name][1].itemsize
            assert peak < 1.5 * copy and written < 1.5 * copy, (rank, name, peak / copy, out)
            assert peak < out["pytorch_fp16"][0] + 0.1 * copy, (rank, name, out)
        # bfloat16 values take as many bytes as float16 ones, and nothing else may differ.
        assert out["bf16"][0] < out["fp16"][0] + 0.02 * ELEMENTS * 2, (rank, out)


# ----------------------------------------------------------------------------------------------
# A peer killed by SIGKILL: the backend's error, not a failure to read the hook's result
# ----------------------------------------------------------------------------------------------
PG_TIMEOUT = 10
KILLED_AT_STEP = 2
HOOKS = {
    "fp16": commhooks.fp16_compress_hook,
    "bf16": commhooks.bf16_compress_hook,
    "fp16_wrapper": commhooks.fp16_compress_wrapper(commhooks.allreduce_hook),
    "allreduce": commhooks.allreduce_hook,
}


def _train_until_the_peer_dies(rank, hook_name, bucket_cap_mb):
    # 1.3 MB of gradients: one bucket when it may hold them all.
    ddp = make_ddp(make_mlp(widths=(32, 512, 512, 8)), HOOKS[hook_name], None, bucket_cap_mb)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    started = time.monotonic()
    try:
        for step, (x, y) in enumerate(batches(rank, KILLED_AT_STEP + 2)):
            if step == KILLED_AT_STEP:
                if rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                started = time.monotonic()
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}", time.monotonic() - started
    return "no error", time.monotonic() - started


def _peer_rank(rank, store, fn, args, queue):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT),
    )
    queue.put((rank, fn(rank, *args)))
    queue.close()
    queue.join_thread()
    os._exit(0)  # skip teardown: the peer is gone


def _outcome_of_the_survivor(fn, *args):
    """Run ``fn(rank, *args)`` on two ranks, of which rank 1 kills itself; rank 0's result.

    ``commhooks.testing.run_on_ranks`` stops at the first rank that dies; here that is the
    point, and what the surviving rank saw is the result.
    """
    ctx = multiprocessing.get_context("forkserver")
    with tempfile.TemporaryDirectory(prefix="commhooks-killed-") as tmp:
        queue = ctx.Queue()
        procs = [
            ctx.Process(target=_peer_rank, args=(r, f"{tmp}/store", fn, args, queue), daemon=True)
            for r in range(2)
        ]
        for proc in procs:
            proc.start()
        try:
            rank, outcome = queue.get(timeout=3 * PG_TIMEOUT + 30)
        finally:
            for proc in procs:
                proc.join(5)
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)
        assert rank == 0 and procs[1].exitcode == -signal.SIGKILL
        return outcome


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "hook_name, bucket_cap_mb",
    [("fp16", 0.004), ("fp16", 100.0), ("bf16", 100.0), ("fp16_wrapper", 0.004)],
    ids=["fp16-small-buckets", "fp16-one-bucket", "bf16-one-bucket", "fp16-wrapper"],
)
def test_a_killed_peer_surfaces_the_backends_error(hook_name, bucket_cap_mb):
    error, seconds = _outcome_of_the_survivor(_train_until_the_peer_dies, hook_name, bucket_cap_mb)
    reference, _ = _outcome_of_the_survivor(_train_until_the_peer_dies, "allreduce", 0.004)
    for message in (error, reference):
        assert message.startswith("RuntimeError") and "Unable to cast" not in message, message
        assert "gloo" in message and "peer" in message, message  # gloo's own words
    assert seconds < PG_TIMEOUT + 5, seconds
