"""The float16 and bfloat16 hooks: their memory, their accelerator logic run on CPU, and how they
fail when a peer dies. gloo, 2 ranks.

The other promises (bitwise PyTorch, overflow handling, non-finite gradients) are checked in
``test_default_hooks.py``; here the same promises are checked again with the logic the hooks
follow on an accelerator, forced on CPU tensors.
"""

import contextlib
import datetime
import multiprocessing
import os
import resource
import signal
import tempfile
import time
import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from ddp_utils import FakeBucket, batches, flat_params, make_ddp, make_mlp, train
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_default

import commhooks
from commhooks import _reads, comm
from commhooks.bench import footprint
from commhooks.comm import gloo_cpu
from commhooks.hooks import _half
from commhooks.hooks._held_sums import held_sums
from commhooks.testing import run_on_ranks

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
    # one on top of that, fails here, and so does anything that PyTorch's hook does not need:
    # our hooks' two-rank sum receives the other rank's bucket into 4 MiB, reused chunk by chunk
    # (2 MiB more than gloo's buffer, for a link kept busier).
    scratch = gloo_cpu.CHUNK_BYTES * gloo_cpu.CHUNKS_IN_FLIGHT
    assert scratch <= 4 << 20
    for rank, out in enumerate(run_on_ranks(_memory_per_bucket, 2)):
        for name, (peak, written) in out.items():
            copy = ELEMENTS * MEASURED[name][1].itemsize
            assert peak < 1.5 * copy and written < 1.5 * copy, (rank, name, peak / copy, out)
            extra = scratch - (2 << 20) if name in ("fp16", "bf16") else 0
            assert peak < out["pytorch_fp16"][0] + extra + 0.1 * copy, (rank, name, out)
        # bfloat16 values take as many bytes as float16 ones, and nothing else may differ.
        assert out["bf16"][0] < out["fp16"][0] + 0.02 * ELEMENTS * 2, (rank, out)


# ----------------------------------------------------------------------------------------------
# The finiteness check: a sum first, the minimum and maximum only when the sum is not finite
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_all_finite_finds_every_non_finite_element_and_nothing_else(dtype):
    top = torch.finfo(dtype).max
    assert _half.all_finite(torch.zeros(0, dtype=dtype))
    assert _half.all_finite(torch.tensor([1.0, -2.0, 0.5], dtype=dtype))
    # Finite elements whose total is beyond the dtype's range: the sum overflows, the check
    # must not.
    assert not torch.isfinite(torch.full((8,), top, dtype=dtype).sum())
    assert _half.all_finite(torch.full((8,), top, dtype=dtype))
    assert _half.all_finite(torch.tensor([top, top, -top], dtype=dtype))
    for bad in (float("inf"), -float("inf"), float("nan")):
        for where in (0, 5, 999):
            x = torch.full((1000,), 0.5, dtype=dtype)
            x[where] = bad
            assert not _half.all_finite(x), (bad, where)
    both = torch.tensor([float("inf"), -float("inf"), 1.0], dtype=dtype)  # a sum of NaN
    assert not _half.all_finite(both)


def _large_finite_bucket(rank, world_size):
    # Every element and every average fits float16, but the bucket's total does not: the hook
    # must take PyTorch's path, bit for bit, without re-sending or warning. (The first call
    # sets up the group's follow-up issuer and checks the ranks agree: not counted.)
    values = torch.full((4096,), 3e4 if rank == 0 else 2e4)
    commhooks.fp16_compress_hook(None, FakeBucket([torch.ones(8)])).wait()
    with warnings.catch_warnings(record=True) as caught, comm.observe_collectives() as sent:
        warnings.simplefilter("always")
        ours = commhooks.fp16_compress_hook(None, FakeBucket([values])).wait()
    theirs = torch_default.fp16_compress_hook(dist.group.WORLD, FakeBucket([values])).wait()
    return ours, theirs, [str(w.message) for w in caught], dict(sent.calls)


@pytest.mark.timeout(60)
def test_a_bucket_whose_total_overflows_is_still_averaged_as_pytorch_does():
    for ours, theirs, caught, calls in run_on_ranks(_large_finite_bucket, 2):
        assert calls == {"all_reduce": 1}, calls  # nothing sent again
        assert torch.equal(ours, theirs)
        torch.testing.assert_close(ours, torch.full_like(ours, 25000.0), rtol=1e-3, atol=0)
        assert caught == []


# ----------------------------------------------------------------------------------------------
# The accelerator's logic, forced on CPU tensors
# ----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _as_on_an_accelerator():
    """CPU tensors take an accelerator's paths: follow-ups (which read the checks) held until
    the last bucket, and no check read back in the wrappers."""
    with mock.patch.object(comm, "holds_follow_ups", lambda devices: True), _reads.as_on_a_gpu():
        yield


def _promises_on_an_accelerator(rank, world_size):
    out = {}
    with _as_on_an_accelerator():
        data = batches(rank, 4)
        for name, ours, theirs in (
            ("hook", commhooks.fp16_compress_hook, torch_default.fp16_compress_hook),
            (
                "wrapper",
                commhooks.fp16_compress_wrapper(commhooks.allreduce_hook),
                torch_default.fp16_compress_wrapper(torch_default.allreduce_hook),
            ),
        ):
            a, b = make_ddp(make_mlp(), ours), make_ddp(make_mlp(), theirs)
            train(a, data)
            train(b, data)
            out[name] = flat_params(a.module), flat_params(b.module)
        out["buckets"] = _held_buckets(rank)
        out["abandoned"] = _abandoned_step(rank)
        out["clip"] = _clipped_without_reading(rank)
    return out


# Per bucket: rank 0's values, rank 1's values, what each of the hook's promises gives.
BUCKETS = [
    ([1.0, -2.5], [3.0, 0.25], [2.0, -1.125]),  # plain
    ([7e4, 0.5], [0.0, 0.5], [35008.0, 0.5]),  # rank 0's cast overflows; divided first, fits
    ([7e4, 1.0], [7e4, 3.0], [7e4, 2.0]),  # the average is beyond float16: re-sent in float32
    ([float("nan"), 1.0, 7e4], [1.0, 1.0, 0.0], [float("nan"), 1.0, 3.5e4]),  # as allreduce
]


def _held_buckets(rank):
    """Several buckets of one step: nothing is read back (no step runs) before the last."""
    issuer = comm.issuer_for(dist.group.WORLD)
    futures = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for index, values in enumerate(BUCKETS):
            bucket = FakeBucket([torch.tensor(values[rank])], index, last=False)
            futures.append(commhooks.fp16_compress_hook(None, bucket))
        time.sleep(0.5)  # long enough for every collective above to complete
        held = (held_sums(issuer).pending, [f.done() for f in futures])
        last = FakeBucket([torch.tensor(BUCKETS[0][rank])], len(BUCKETS), last=True)
        futures.append(commhooks.fp16_compress_hook(None, last))
        values = [f.wait() for f in futures]
    return held, values, [str(w.message) for w in caught]


def _abandoned_step(rank):
    """A step whose last bucket never came (an exception in the backward pass, say): the next
    step's call on the same buffer drops its held sum, so nothing stale lands in the buffer."""
    bucket = FakeBucket([torch.tensor([1.0, 2.0]) * (rank + 1)], 0, last=False)
    stale = commhooks.fp16_compress_hook(None, bucket)
    bucket.buffer().copy_(torch.tensor([10.0, 20.0]) * (rank + 1))
    last = FakeBucket([torch.zeros(2)], 0, last=True)
    last.set_buffer(bucket.buffer())  # DDP's next step: the same bucket buffer
    fresh = commhooks.fp16_compress_hook(None, last)
    try:
        stale.wait()
        stale_error = ""
    except RuntimeError as exc:
        stale_error = str(exc)
    return stale_error, fresh.wait().tolist(), held_sums(comm.issuer_for(dist.group.WORLD)).pending


def _clipped_without_reading(rank):
    hook = commhooks.fp16_compress_wrapper(commhooks.noop_hook)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        inf = float("inf")
        out = hook(None, FakeBucket([torch.tensor([1e6, -1e6, 1.0, inf, -inf])])).wait()
    return out, len(caught)


def _float16_bucket_through_the_wrapper(rank, world_size):
    inf = float("inf")
    grads = torch.tensor([1.0, inf, -inf, 65504.0, -2.5], dtype=torch.float16)
    hook = commhooks.fp16_compress_wrapper(commhooks.noop_hook)
    return grads, hook(None, FakeBucket([grads.clone()])).wait()


def test_fp16_wrapper_keeps_a_float16_buckets_infinities():
    # A float16 model's bucket is cast to itself: no copy, and nothing beyond float16's range;
    # its own inf must reach a loss scaler as inf, not clipped to 65504 in place.
    for grads, out in run_on_ranks(_float16_bucket_through_the_wrapper, 1):
        assert torch.equal(out, grads)


@pytest.mark.timeout(120)
def test_the_accelerator_logic_keeps_every_promise():
    for out in run_on_ranks(_promises_on_an_accelerator, 2):
        for name in ("hook", "wrapper"):
            ours, theirs = out[name]
            assert torch.equal(ours, theirs), name
        (pending, done), values, messages = out["buckets"]
        assert pending == len(BUCKETS) and not any(done)
        for got, (_, _, expected) in zip(values, BUCKETS):
            expected = torch.tensor(expected)
            assert torch.equal(got.isnan(), expected.isnan()), (got, expected)
            assert torch.equal(got.nan_to_num(), expected.nan_to_num()), (got, expected)
        assert len(messages) == 1 and "re-sent in torch.float32" in messages[0]
        stale_error, fresh, pending = out["abandoned"]
        assert "abandoned with its step" in stale_error
        assert fresh == [15.0, 30.0] and pending == 0  # the new step's average, (10 + 20) / 2
        clipped, warned = out["clip"]
        inf = float("inf")
        assert torch.equal(clipped, torch.tensor([65504.0, -65504.0, 1.0, inf, -inf]))
        assert warned == 0  # counting the clipped values would mean reading back


def test_a_held_bucket_whose_collective_failed_fails_alone_and_as_a_real_error():
    # Each held bucket's future is derived from its step's gate: a failed sum raises on that
    # bucket's future (DDP then reports the backend's error), and the others hold their buffers.
    from commhooks.hooks._held_sums import HeldSums

    held = HeldSums(comm.OrderedIssuer())
    buffers = [torch.full((3,), 5.0 + i) for i in range(3)]
    failed: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
    failed.set_exception(RuntimeError("NCCL error: the peer went away"))
    sums = [comm.completed([torch.zeros(3)]), failed, comm.completed([torch.ones(3)])]
    with comm.completing_inline():
        outs = [
            held.file(b, s, lambda buffer: (), last_bucket=i == 2)
            for i, (b, s) in enumerate(zip(buffers, sums))
        ]
    assert all(out.done() for out in outs) and held.pending == 0
    assert outs[0].wait() is buffers[0] and torch.equal(buffers[0], torch.zeros(3))
    assert outs[2].wait() is buffers[2] and torch.equal(buffers[2], torch.ones(3))
    with pytest.raises(RuntimeError, match="the peer went away"):
        outs[1].wait()
    assert torch.equal(buffers[1], torch.full((3,), 6.0))  # left as it was


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
