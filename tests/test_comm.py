"""``comm``: the ordering guarantee of ``OrderedIssuer``, and sums over ranks."""

import contextlib
import gc
import random
import subprocess
import sys
import threading
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from commhooks import comm
from commhooks.comm import gloo_cpu
from commhooks.testing import run_on_ranks


def test_futures_of_cpu_tensors_need_no_stream_order():
    t = torch.ones(3)
    assert comm.future_devices(t, [t, 2.0], None) == []
    assert comm.completed(t).wait() is t


def test_follow_ups_start_in_slot_order_whatever_completes_first():
    issuer = comm.OrderedIssuer()
    started: list[int] = []
    firsts = [torch.futures.Future() for _ in range(50)]
    outs = [
        issuer.then(f, lambda v, i=i: (started.append(i), comm.completed(v))[1])
        for i, f in enumerate(firsts)
    ]
    order = list(range(50))
    random.Random(0).shuffle(order)
    threads = [threading.Thread(target=firsts[i].set_result, args=(i,)) for i in order]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert started == list(range(50))
    assert [o.wait() for o in outs] == list(range(50))
    assert issuer.pending == 0


def test_a_failed_first_round_releases_its_slot_and_passes_the_error_on():
    issuer = comm.OrderedIssuer()
    first, second = torch.futures.Future(), torch.futures.Future()
    started = []
    out1 = issuer.then(first, lambda v: (started.append(1), comm.completed(v))[1])
    out2 = issuer.then(second, lambda v: (started.append(2), comm.completed(v))[1])
    second.set_result("b")
    assert started == []  # held back behind slot 0
    first.set_exception(RuntimeError("collective failed"))
    assert started == [2] and out2.wait() == "b"
    with pytest.raises(RuntimeError, match="collective failed"):
        out1.wait()


def test_a_step_that_raises_fails_only_its_own_future():
    issuer = comm.OrderedIssuer()
    a, b = torch.futures.Future(), torch.futures.Future()
    out_a = issuer.then(a, lambda v: 1 / 0)
    out_b = issuer.then(b, lambda v: comm.completed(v))
    b.set_result(7)
    a.set_result(0)
    with pytest.raises(ZeroDivisionError):
        out_a.wait()
    assert out_b.wait() == 7


def test_held_follow_ups_wait_for_a_later_slot_without_hold_then_run_first_in_order():
    issuer = comm.OrderedIssuer()
    started: list[int] = []

    def step(i):
        return lambda v: (started.append(i), comm.completed(v))[1]

    outs = [issuer.then(comm.completed(i), step(i), hold=True) for i in range(3)]
    assert started == [] and issuer.pending == 3  # their collectives are done, yet they wait
    last_first = torch.futures.Future()
    outs.append(issuer.then(last_first, step(3)))
    assert started == [0, 1, 2]  # released, in order, on this thread
    last_first.set_result(3)
    assert started == [0, 1, 2, 3]
    assert [o.wait() for o in outs] == [0, 1, 2, 3] and issuer.pending == 0


def test_held_follow_ups_released_by_inline_futures_run_in_a_loop_not_nested():
    # NCCL completes a collective's future as soon as it is queued, so releasing the held
    # steps of many buckets used to nest a few frames per bucket: past about 75 buckets the
    # stack overflowed, callbacks were lost and DDP waited forever.
    issuer = comm.OrderedIssuer()
    buckets = 10_000
    depths: list[int] = []

    def step(value):
        frame, depth = sys._getframe(), 0
        while frame is not None:
            frame, depth = frame.f_back, depth + 1
        depths.append(depth)
        return comm.completed(value)

    outs = []
    for b in range(buckets):
        hold = b != buckets - 1
        first = issuer.then(comm.completed(b), step, hold=hold)  # two follow-ups a bucket,
        outs.append(issuer.then(first, step, hold=hold))  # chained as _half.py chains them
    assert all(o.done() for o in outs) and issuer.pending == 0
    assert [o.wait() for o in outs] == list(range(buckets))
    assert max(depths) - min(depths) <= 2  # the same depth for the first bucket and the last


# Every hook, through DDP, on many buckets: once as on gloo, once with futures completing
# inline and follow-ups held until the last bucket, as on NCCL (comm.completing_inline).
_MANY_BUCKETS = (32,) + (8,) * 60  # 60 layers: 120 buckets, one a parameter


def _every_hook(rank):
    import commhooks

    power = dict(start_powerSGD_iter=2)
    return {
        "allreduce": lambda ddp: ddp.register_comm_hook(None, commhooks.allreduce_hook),
        "fp16": lambda ddp: ddp.register_comm_hook(None, commhooks.fp16_compress_hook),
        "bf16": lambda ddp: ddp.register_comm_hook(None, commhooks.bf16_compress_hook),
        "fp16_wrapper": lambda ddp: ddp.register_comm_hook(
            None, commhooks.fp16_compress_wrapper(commhooks.allreduce_hook)
        ),
        "power_sgd": lambda ddp: commhooks.register(ddp, "power_sgd", **power),
        "single_round": lambda ddp: commhooks.register(ddp, "power_sgd_single_round", **power),
        "batched": lambda ddp: commhooks.register(ddp, "batched_power_sgd", **power),
        "int8": lambda ddp: commhooks.register(ddp, "int8"),
        "int4": lambda ddp: commhooks.register(ddp, "int4"),
        "post_local_sgd": lambda ddp: commhooks.register(
            ddp, "post_local_sgd", start_localSGD_iter=2
        ),
        "quantize_per_tensor": lambda ddp: ddp.register_comm_hook(
            None, commhooks.quantization_pertensor_hook
        ),
    }


def _inline_against_gloo(rank, world_size):
    from ddp_utils import batches, flat_params, make_ddp, make_mlp, train

    out = {}
    for inline in (False, True):
        for name, attach in _every_hook(rank).items():
            ddp = make_ddp(make_mlp(widths=_MANY_BUCKETS), bucket_cap_mb=0.00001)
            attach(ddp)
            with comm.completing_inline() if inline else contextlib.nullcontext():
                train(ddp, batches(rank, 4))
            out[name, inline] = flat_params(ddp.module)
    return out


@pytest.mark.timeout(150)
def test_every_hook_completes_with_inline_futures_and_held_follow_ups_on_many_buckets():
    for out in run_on_ranks(_inline_against_gloo, 2, timeout=140):
        for name in _every_hook(0):
            assert torch.isfinite(out[name, True]).all(), name
            assert torch.equal(out[name, True], out[name, False]), name


def test_the_inline_seam_completes_futures_before_returning_them():
    out = run_on_ranks(_inline_collectives, 2)
    assert out == [(True, True, True, True, False)] * 2


def _inline_collectives(rank, world_size):
    group = dist.group.WORLD
    with comm.completing_inline():
        summed = comm.allreduce(torch.ones(3), group)
        gathered = comm.all_gather_into(torch.empty(2, 3), torch.ones(3), group)
        held = comm.holds_follow_ups([])
        # Where callbacks run on the issuing thread (NCCL), follow-ups need no group of their
        # own: none is made inside a hook, which eager NCCL initialisation could not split.
        shared = comm.follow_up_group(group) is group
    return (
        summed.done() and gathered.done(),
        torch.equal(summed.value(), torch.full((3,), 2.0)),
        held,
        shared,
        comm.follow_up_group(group) is group,  # gloo: a group of their own
    )


def _sums(rank, world_size):
    with comm.observe_collectives(torch_calls=True) as counter:
        out = _sum_each_shape(rank)
    return out, counter.calls, counter.bytes


def _sum_each_shape(rank):
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(rank)
    out = {}
    for name, shape, dtype in (
        ("small", (40, 3), torch.float32),
        ("half", (17,), torch.float16),
        ("strided", (7, 5), torch.float32),  # summed through a contiguous copy
        ("empty", (0,), torch.float32),
        ("large", (gloo_cpu.CHUNK_BYTES // 2 + 1,), torch.bfloat16),  # two chunks
        ("large_float32", (gloo_cpu.SMALL_BYTES // 4 + 1,), torch.float32),  # gloo's allreduce
        ("integer", (1000,), torch.int64),  # gloo's allreduce
    ):
        t = torch.randn(shape, generator=gen).to(dtype)
        if name == "strided":
            t = t.t()
        reference = t.clone()
        dist.all_reduce(reference)
        result = comm.allreduce(t, group).wait()
        out[name] = (result is t, torch.equal(t, reference), gloo_cpu.sums(t, group))
    return out


def test_allreduce_sums_like_dist_all_reduce_on_any_world_size():
    # Two gloo ranks exchange floating-point tensors and add them; the result is the same bits
    # as gloo's allreduce, and the bench counts it as the allreduce it stands for.
    for world_size in (2, 3):
        for out, calls, sent in run_on_ranks(_sums, world_size):
            two = world_size == 2
            for name in ("small", "half", "strided", "empty", "large"):
                assert out[name] == (True, True, two)
            assert out["large_float32"] == out["integer"] == (True, True, False)
            assert set(calls) == {"all_reduce"}  # the references, then the sums
            assert calls["all_reduce"] == 14
            large = (gloo_cpu.CHUNK_BYTES // 2 + 1) * 2 + (gloo_cpu.SMALL_BYTES // 4 + 1) * 4
            assert sent["all_reduce"] == 2 * (40 * 3 * 4 + 17 * 2 + 35 * 4 + large + 8000)


def _refuse(summed):
    raise ValueError(f"refused a sum of {summed.numel()} elements")


def _sums_then(rank, world_size):
    group = dist.group.WORLD
    out = []
    for shape, strided in (
        ((40,), False),
        ((gloo_cpu.SMALL_BYTES // 4 + 1,), False),
        ((5, 7), True),
    ):
        t = torch.full(shape, float(rank + 1))
        t = t.t() if strided else t
        fut = comm.allreduce_then(t, group, lambda s, t=t: (s is t, s.sum().item()))
        same, total = fut.wait()
        out.append((same, total == 3.0 * t.numel(), torch.equal(t, torch.full_like(t, 3.0))))
    with pytest.raises(RuntimeError, match="refused a sum of 3 elements"):
        comm.allreduce_then(torch.ones(3), group, _refuse).wait()
    with comm.completing_inline():
        fut = comm.allreduce_then(torch.ones(3), group, lambda s: s.div_(2))
        out.append(fut.done() and torch.equal(fut.value(), torch.ones(3)))
    return out


def _rounds_on_sums(rank, world_size):
    group = dist.group.WORLD
    issuer = comm.issuer_for(group)
    out = []
    for numel in (40, gloo_cpu.SMALL_BYTES // 4 + 1):  # the exchange, gloo's allreduce
        t = torch.full((numel,), float(rank + 1))
        finished = comm.allreduce_rounds(t, group, issuer, (lambda s, t=t: comm.Finished(s is t),))
        again = comm.allreduce_rounds(
            torch.full((numel,), float(rank + 1)),
            group,
            issuer,
            (
                lambda s: comm.Issue(lambda: comm.allreduce(s.clone(), issuer.group)),
                lambda s: comm.Finished(float(s[0])),
            ),
        )
        out.append((finished.wait(), again.wait(), torch.equal(t, torch.full_like(t, 3.0))))
    return out


def test_allreduce_rounds_runs_the_first_round_on_the_sum_itself():
    # One round that finishes on the summed tensor itself; two that send the sum again.
    for out in run_on_ranks(_rounds_on_sums, 2):
        assert out == [(True, 6.0, True)] * 2


def test_allreduce_then_hands_the_sum_to_its_function_in_one_future():
    # The exchange of two gloo ranks, gloo's own allreduce (over 1 MiB of float32) and a
    # strided tensor (summed through a copy): the function sees the tensor itself, summed.
    for out in run_on_ranks(_sums_then, 2):
        assert out == [(True, True, True)] * 3 + [True]


def _sums_of_each_dtype(rank, world_size):
    group = dist.group.WORLD
    out, calls_all, sent_all = {}, [], []
    for name, numel, dtype in SIZES:
        values = torch.randn(numel, generator=torch.Generator().manual_seed(rank)) * 100
        reference = values.to(dtype, copy=True).div_(world_size)
        dist.all_reduce(reference)
        tensor = values.to(dtype, copy=True).div_(world_size)
        with comm.observe_collectives(torch_calls=True) as counter:
            result = comm.allreduce(tensor, group).wait()
            calls_all.append(dict(counter.calls))
            sent_all.append(dict(counter.bytes))
        out[name] = (result is tensor, torch.equal(tensor, reference))
    calls, sent = {}, {}
    for one, nbytes in zip(calls_all, sent_all, strict=True):
        for kind in one:
            calls[kind] = calls.get(kind, 0) + one[kind]
            sent[kind] = sent.get(kind, 0) + nbytes[kind]
    return out, calls, sent


# Half precision in chunks of gloo_cpu.CHUNK_BYTES: more than are in flight at once (the last
# short, and received into a buffer freed by an earlier one), then 2, then 1.
SIZES = (
    ("half", (gloo_cpu.CHUNKS_IN_FLIGHT + 1) * gloo_cpu.CHUNK_BYTES // 2 + 1, torch.float16),
    ("bfloat16", gloo_cpu.CHUNK_BYTES // 2 + 2, torch.bfloat16),
    ("small", 100, torch.float16),
    ("float32", gloo_cpu.SMALL_BYTES // 4, torch.float32),  # the largest float32 exchanged
    ("float32_large", gloo_cpu.SMALL_BYTES // 4 + 1, torch.float32),  # gloo's allreduce
)


def test_sums_of_each_dtype_equal_gloos_allreduce_bit_for_bit():
    for world_size in (2, 3):
        for out, calls, sent in run_on_ranks(_sums_of_each_dtype, world_size):
            for name, (same, equal) in out.items():
                assert same and equal, name
            # Counted as the allreduce each one stands for, whichever path summed it.
            assert calls == {"all_reduce": len(SIZES)}
            assert sent["all_reduce"] == sum(
                numel * torch.tensor([], dtype=d).element_size() for _, numel, d in SIZES
            )


def _sums_in_flight(rank, world_size):
    # Sums issued one after another without waiting, as DDP issues its buckets: the later
    # chunks of each are received while the next sums' messages are already on the way.
    group, chunk, k = dist.group.WORLD, gloo_cpu.CHUNK_BYTES // 2, gloo_cpu.CHUNKS_IN_FLIGHT
    lengths = ((k + 1) * chunk + 3, 7, 3 * chunk, chunk - 1, 2 * k * chunk + 1)
    tensors = [
        (torch.full((n,), float(i)) + torch.arange(n) % 97 * (rank + 1)).to(dtype)
        for i, n in enumerate(lengths)
        for dtype in (torch.float16, torch.bfloat16)
    ]
    references = [t.clone() for t in tensors]
    for reference in references:
        dist.all_reduce(reference)
    futures = [comm.allreduce(t, group) for t in tensors]
    return [torch.equal(f.wait(), r) for f, r in zip(futures, references, strict=True)]


def test_sums_in_flight_together_each_get_their_own_chunks():
    for out in run_on_ranks(_sums_in_flight, 2):
        assert out == [True] * 10


def _observed(rank, world_size):
    group, t = dist.group.WORLD, torch.ones(10)  # 40 bytes
    plain = dist.all_reduce
    with comm.observe_collectives() as ours:
        comm.allreduce(t.clone(), group).wait()
        dist.all_reduce(t.clone())  # not through comm: seen only with torch_calls
        with comm.observe_collectives(torch_calls=True) as everything:
            wrapped = dist.all_reduce is not plain
            comm.allreduce(t.clone(), group).wait()  # an exchange inside: counted once
            dist.all_gather_into_tensor(torch.empty(20), t)  # what this rank hands over
            # follow-ups are issued from the backend's threads: counted there too
            thread = threading.Thread(target=lambda: comm.allreduce(t.clone(), group).wait())
            thread.start()
            thread.join()
    return {
        "ours": (ours.calls, ours.bytes),
        "everything": (everything.calls, everything.bytes),
        "wrapped": wrapped,
        "restored": dist.all_reduce is plain,
    }


def test_observers_count_what_each_collective_hands_over():
    for out in run_on_ranks(_observed, 2):
        assert out["ours"] == ({"all_reduce": 3}, {"all_reduce": 120})
        assert out["everything"] == (
            {"all_reduce": 2, "all_gather_into_tensor": 1},
            {"all_reduce": 80, "all_gather_into_tensor": 40},
        )
        assert out["wrapped"] and out["restored"]


# Rows of a few MB and of a few bytes, each sent as one message per pair of ranks on gloo.
_LONG = 3 * (256 << 10) + 1000
_SHORT = 1000


def _exchanges(rank, world_size):
    group = dist.group.WORLD
    out = {}
    for length in (_LONG, _SHORT):
        # Every byte says who sent it, to whom, and where it was in the row.
        place = torch.arange(length, dtype=torch.int64) % 251
        rows = torch.stack([(place + 7 * rank + 3 * dest) % 256 for dest in range(world_size)])
        sent = rows.to(torch.uint8)
        received = torch.empty_like(sent)
        with comm.observe_collectives(torch_calls=True) as seen:
            assert comm.all_to_all(received, sent, group).wait() is received
        mine = sent[rank].clone()
        gathered = torch.empty(world_size, length, dtype=torch.uint8)
        assert comm.all_gather_into(gathered, mine, group).wait() is gathered
        expected_in = torch.stack(
            [((place + 7 * src + 3 * rank) % 256).to(torch.uint8) for src in range(world_size)]
        )
        expected_gather = torch.stack(
            [((place + 7 * src + 3 * src) % 256).to(torch.uint8) for src in range(world_size)]
        )
        # Issued straight on the group (NCCL's path): the same rows, counted alike.
        straight_in, straight_gather = torch.empty_like(received), torch.empty_like(gathered)
        with comm.observe_collectives() as issued:
            comm.issue_all_to_all(straight_in, sent, group).wait()
            comm.issue_all_gather(straight_gather, mine, group).wait()
        straight = torch.equal(straight_in, expected_in) and torch.equal(
            straight_gather, expected_gather
        )
        out[length] = (
            torch.equal(received, expected_in),
            torch.equal(gathered, expected_gather),
            seen.calls,
            seen.bytes,
            straight,
            issued.bytes,
        )
    return out


def test_rows_land_where_one_collective_puts_them():
    for out in run_on_ranks(_exchanges, 3):
        for length, (exchanged, gathered, calls, sent, straight, issued) in out.items():
            assert exchanged and gathered and straight, length
            # Reported as the one all-to-all it stands for, with every byte handed over.
            assert calls == {"all_to_all_single": 1}
            assert sent == {"all_to_all_single": 3 * length}
            assert issued == {"all_to_all_single": 3 * length, "all_gather_into_tensor": length}


def _posting_order(rank, world_size):
    """Every torch.distributed call the exchanges make, in order, and whether they were right."""
    group, posted = dist.group.WORLD, []
    real = {name: getattr(dist, name) for name in ("isend", "irecv")}

    def recording(name):
        def call(tensor, peer, *args, **kwargs):
            posted.append((name, peer))
            return real[name](tensor, peer, *args, **kwargs)

        return call

    rows = torch.arange(world_size * 5, dtype=torch.float32).view(world_size, 5) + 100 * rank
    received = torch.empty_like(rows)
    gathered = torch.empty(world_size, 5)
    with mock.patch.multiple(dist, isend=recording("isend"), irecv=recording("irecv")):
        comm.all_to_all(received, rows, group).wait()
        comm.all_gather_into(gathered, rows[rank], group).wait()
        small = torch.full((3,), float(rank + 1))
        comm.allreduce(small, group).wait()
    return posted, received, gathered, small, gloo_cpu.sums(small, group)


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_receive_is_posted_before_any_send_of_an_exchange(world_size):
    # gloo starts a send only once the peer's receive is posted, and says so in the same TCP
    # stream as the data: a send posted first can hold the peer's whole message up behind it.
    for rank, (posted, received, gathered, small, swapped) in enumerate(
        run_on_ranks(_posting_order, world_size)
    ):
        peers = [r for r in range(world_size) if r != rank]
        one_exchange = [("irecv", p) for p in peers] + [("isend", p) for p in peers]
        exchanges = 3 if swapped else 2  # two ranks also sum small tensors by an exchange
        assert posted == one_exchange * exchanges, (rank, posted)
        assert swapped == (world_size == 2)
        for src in range(world_size):
            row = torch.arange(5, dtype=torch.float32) + 5 * rank + 100 * src
            assert torch.equal(received[src], row)
            assert torch.equal(gathered[src], torch.arange(5.0) + 5 * src + 100 * src)
        assert torch.equal(small, torch.full((3,), float(sum(range(1, world_size + 1)))))


_EXIT_SCRIPT = """
import sys, torch, torch.distributed as dist
from commhooks import comm
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
rows = torch.full((2, 1 << 16), float(rank))
for _ in range(20):
    comm.all_to_all(torch.empty_like(rows), rows, dist.group.WORLD)
comm.allreduce(torch.ones(4), dist.group.WORLD).wait()
print("done", flush=True)
"""


def test_a_process_that_exits_right_after_an_exchange_exits_cleanly(tmp_path):
    # The exchanges complete on a thread of the package's own; one still inside torch when the
    # interpreter shuts down would be ended where it stands, aborting the process (exit -6,
    # "terminate called without an active exception") after training had finished.
    script = tmp_path / "exit.py"
    script.write_text(_EXIT_SCRIPT)
    for attempt in range(5):
        for code, out in _run_two_ranks(script, tmp_path / f"store{attempt}"):
            assert code == 0 and "done" in out and "terminate" not in out, out


def _run_two_ranks(script: Path, store: Path) -> list[tuple[int, str]]:
    """Each rank's exit code and output, for ``script`` run as ranks 0 and 1 of a file store."""
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(store)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [proc.communicate(timeout=60)[0] for proc in procs]
    return [(proc.returncode, out) for proc, out in zip(procs, outputs)]


_DESTROYED_GROUP_SCRIPT = """
import atexit, gc, sys, threading, time
def threads_left():  # registered first, so it runs after the package's own exit handler
    left = [t.name for t in threading.enumerate() if t.name == "commhooks-swap"]
    print("swap threads at exit:", len(left), flush=True)
atexit.register(threads_left)
import torch, torch.distributed as dist
from commhooks import comm
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
pair = dist.new_group([0, 1])
rows = torch.full((2, 1 << 10), float(rank))
done = comm.all_to_all(torch.empty_like(rows), rows, pair)
# A callback of the last exchange still running on the package's thread when the group goes.
slow = done.then(lambda fut: time.sleep(0.5))
done.wait()
dist.barrier()
dist.destroy_process_group()
del pair
gc.collect()
print("done", flush=True)
"""


def test_exit_waits_for_the_thread_of_a_destroyed_group(tmp_path):
    # A group destroyed (and collected) stops its exchanges' thread without waiting for it; the
    # thread may still be running the last exchange's callbacks, inside torch, and must be over
    # before the interpreter shuts down, as it is for a group that outlives the run.
    script = tmp_path / "destroyed.py"
    script.write_text(_DESTROYED_GROUP_SCRIPT)
    for code, out in _run_two_ranks(script, tmp_path / "store"):
        assert code == 0 and "done" in out, out
        assert "swap threads at exit: 0" in out, out


def _group_facts(rank, world_size):
    # Sizes and "two gloo ranks" are remembered per group: each group answers for itself.
    pair = dist.new_group([0, 1])  # made on every rank; rank 2 is outside it
    alone = dist.new_group([rank])
    world = dist.group.WORLD
    out = []
    for _ in range(2):  # asked again, from memory
        out.append((comm.size(world), comm.size(alone), gloo_cpu.sums(torch.ones(3), world)))
    if rank < 2:
        out.append((comm.size(pair), gloo_cpu.sums(torch.ones(3), pair)))
        out.append(gloo_cpu.sums(torch.ones(3, dtype=torch.int64), pair))  # integers never
    return out


def test_a_groups_size_and_pairing_are_its_own_and_stay_so():
    for rank, out in enumerate(run_on_ranks(_group_facts, 3)):
        assert out[0] == out[1] == (3, 1, False)
        if rank < 2:
            assert out[2] == (2, True) and out[3] is False


def test_options_ask_for_no_wait_only_where_torch_has_the_field():
    # torch before 2.7 has no ``asyncOp`` on its options (its group calls never waited):
    # setting one there would fail the package's import.
    class Older:
        __slots__ = ("timeout",)

    older = Older()
    assert comm._without_waiting(older) is older and not hasattr(older, "asyncOp")
    newer = dist.AllreduceOptions()
    newer.asyncOp = False
    assert comm._without_waiting(newer).asyncOp is True


_RECREATED_GROUPS_SCRIPT = """
import gc, os, sys, tempfile, weakref, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import commhooks
from commhooks import comm
HOOKS = ["allreduce", "fp16", "bf16", "int8", "power_sgd", "power_sgd_single_round"]
worlds = []
for cycle in range(3):
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        with comm.completing_inline():  # follow-ups share the hook's group, as on NCCL
            for name in HOOKS if cycle else ["none"]:  # the first: plain DDP
                ddp = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)),
                          bucket_cap_mb=0.0001)
                if name != "none":
                    commhooks.register(ddp, name, **({"start_powerSGD_iter": 1}
                                                     if "power" in name else {}))
                for _ in range(3):
                    ddp(torch.randn(2, 8)).sum().backward()
                del ddp
        worlds.append(weakref.ref(dist.group.WORLD))
        dist.destroy_process_group()
        gc.collect()
print("alive after destroy:", [w() is not None for w in worlds], flush=True)
"""


def test_a_destroyed_group_whose_follow_ups_it_carried_is_not_kept_alive(tmp_path):
    # Where follow-ups share the hook's group (NCCL's way), the stateless hooks' issuer and
    # the held sums had kept every group alive after destroy_process_group. The first cycle
    # runs plain DDP, whose first group torch keeps itself: only the later ones are ours.
    script = tmp_path / "recreated.py"
    script.write_text(_RECREATED_GROUPS_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "alive after destroy: [True, False, False]" in proc.stdout or (
        "alive after destroy: [False, False, False]" in proc.stdout
    ), proc.stdout


def test_a_borrowed_group_is_held_weakly_and_its_loss_named():
    class Group:  # stands for a process group: only identity and weak references matter
        pass

    group = Group()
    issuer = comm.OrderedIssuer(group, borrowed=True)  # type: ignore[arg-type]
    assert issuer.group is group
    owned = comm.OrderedIssuer(group)  # type: ignore[arg-type]
    del group
    gc.collect()
    assert owned.group is not None  # an issuer that owns its group keeps it
    del owned
    gc.collect()
    with pytest.raises(RuntimeError, match="destroy_process_group"):
        _ = issuer.group
