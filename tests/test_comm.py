"""commhooks.comm: ordered follow-ups, the inline seam, the collectives, the observers, groups."""

import contextlib
import gc
import random
import subprocess
import sys
import threading
import warnings

import pytest
import torch
import torch.distributed as dist

from commhooks import comm
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


def test_follow_ups_completing_inline_run_in_a_loop_not_nested():
    # NCCL completes a collective's future as soon as it is queued, so every follow-up of many
    # buckets runs at once: nested runs overflowed Python's stack past about 75 buckets, the
    # callback was lost and DDP waited forever.
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
        first = issuer.then(comm.completed(b), step)  # two follow-ups a bucket, chained
        outs.append(issuer.then(first, step))
    assert all(o.done() for o in outs) and issuer.pending == 0
    assert [o.wait() for o in outs] == list(range(buckets))
    assert max(depths) - min(depths) <= 2  # the same depth for the first bucket and the last


# Every hook, through DDP, on many buckets: once as on gloo, once with futures completing
# inline, as on NCCL (comm.completing_inline): one path, the same bits.
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
def test_every_hook_gives_the_same_bits_with_inline_futures_on_many_buckets():
    for out in run_on_ranks(_inline_against_gloo, 2, timeout=140):
        for name in _every_hook(0):
            assert torch.isfinite(out[name, True]).all(), name
            assert torch.equal(out[name, True], out[name, False]), name


def test_the_inline_seam_completes_futures_before_returning_them():
    out = run_on_ranks(_inline_collectives, 2)
    assert out == [(True, True, True, False)] * 2


def _inline_collectives(rank, world_size):
    group = dist.group.WORLD
    with comm.completing_inline():
        summed = comm.allreduce(torch.ones(3), group)
        gathered = comm.all_gather_into(torch.empty(2, 3), torch.ones(3), group)
        # Where callbacks run on the issuing thread (NCCL), follow-ups need no group of their
        # own: none is made inside a hook, which eager NCCL initialisation could not split.
        shared = comm.follow_up_group(group) is group
    return (
        summed.done() and gathered.done(),
        torch.equal(summed.value(), torch.full((3,), 2.0)),
        shared,
        comm.follow_up_group(group) is group,  # gloo: a group of their own
    )


def _observed(rank, world_size):
    group, t = dist.group.WORLD, torch.ones(10)  # 40 bytes
    plain = dist.all_reduce
    with comm.observe_collectives() as ours:
        comm.allreduce(t.clone(), group).wait()
        dist.all_reduce(t.clone())  # not through comm: seen only with torch_calls
        with comm.observe_collectives(torch_calls=True) as everything:
            wrapped = dist.all_reduce is not plain
            comm.allreduce(t.clone(), group).wait()  # torch's own call inside: counted once
            dist.all_gather_into_tensor(torch.empty(20), t)  # what this rank hands over
            newer = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
            newer(torch.empty(20), t)  # recent PyTorch's name for it: the same kind
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                comm.all_gather_into(torch.empty(2, 10), t, group).wait()  # the newer name
            # follow-ups are issued from the backend's threads: counted there too
            thread = threading.Thread(target=lambda: comm.allreduce(t.clone(), group).wait())
            thread.start()
            thread.join()
    return {
        "ours": (ours.calls, ours.bytes),
        "everything": (everything.calls, everything.bytes),
        "wrapped": wrapped,
        "restored": dist.all_reduce is plain,
        "deprecated": [str(w.message) for w in caught if "deprecated" in str(w.message)],
    }


def test_observers_count_what_each_collective_hands_over():
    for out in run_on_ranks(_observed, 2):
        assert out["ours"] == (
            {"all_reduce": 3, "all_gather_into_tensor": 1},
            {"all_reduce": 120, "all_gather_into_tensor": 40},
        )
        assert out["everything"] == (
            {"all_reduce": 2, "all_gather_into_tensor": 3},
            {"all_reduce": 80, "all_gather_into_tensor": 120},
        )
        assert out["wrapped"] and out["restored"] and out["deprecated"] == []


# Rows of a few MB and of a few bytes.
_LONG = 3 * (256 << 10) + 1000
_SHORT = 1000


def _exchanges(rank, world_size):
    group = dist.group.WORLD
    comm.crosses_machines(group)  # as if on three machines: long exchanges go in pieces
    assert comm.pieces_for(torch.empty(_LONG, dtype=torch.uint8), group) == comm.EXCHANGE_PIECES
    out = {}
    for length in (_LONG, _SHORT):
        # Every byte says who sent it, to whom, and where it was in the row.
        place = torch.arange(length, dtype=torch.int64) % 251
        rows = torch.stack([(place + 7 * rank + 3 * dest) % 256 for dest in range(world_size)])
        sent = rows.to(torch.uint8)
        received = torch.empty_like(sent)
        mine = sent[rank].clone()
        gathered = torch.empty(world_size, length, dtype=torch.uint8)
        with comm.observe_collectives(torch_calls=True) as seen:
            assert comm.all_to_all(received, sent, group).wait() is received
            assert comm.all_gather_into(gathered, mine, group).wait() is gathered
        expected_in = torch.stack(
            [((place + 7 * src + 3 * rank) % 256).to(torch.uint8) for src in range(world_size)]
        )
        expected_gather = torch.stack(
            [((place + 7 * src + 3 * src) % 256).to(torch.uint8) for src in range(world_size)]
        )
        out[length] = (
            torch.equal(received, expected_in),
            torch.equal(gathered, expected_gather),
            seen.calls,
            seen.bytes,
        )
    return out


def test_rows_land_where_one_collective_puts_them():
    # The long rows go as several collectives at once (gloo's turns), the short ones whole.
    assert comm.exchange_pieces(_LONG, "gloo") == comm.EXCHANGE_PIECES
    assert comm.exchange_pieces(3 * _SHORT, "gloo") == 1
    assert comm.exchange_pieces(3 * _LONG, "nccl") == 1
    for out in run_on_ranks(_exchanges, 3):
        for length, (exchanged, gathered, calls, sent) in out.items():
            assert exchanged and gathered, length
            assert calls == {"all_to_all_single": 1, "all_gather_into_tensor": 1}
            assert sent == {"all_to_all_single": 3 * length, "all_gather_into_tensor": length}


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
    # Where follow-ups share the hook's group (NCCL's way), an issuer kept for the group must
    # not keep it alive after destroy_process_group. The first cycle runs plain DDP, whose
    # first group torch keeps itself: only the later ones are ours.
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
