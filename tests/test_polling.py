"""Buckets finished on the thread that issued them (``comm.polling``), not in gloo's callbacks."""

import threading
import time

import pytest
import torch
import torch.distributed as dist
from ddp_utils import batches, make_mlp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_default
from torch.nn.parallel import DistributedDataParallel as DDP

import commhooks
from commhooks import comm
from commhooks.comm.polling import PollQueue
from commhooks.testing import run_on_ranks


def _completing_later(value, delay):
    fut = torch.futures.Future()
    threading.Timer(delay, fut.set_result, args=(value,)).start()
    return fut


def test_a_poll_runs_the_completed_front_of_the_queue_in_order_and_stops_at_a_pending_one():
    queue, ran = PollQueue(), []
    first, second, third = (torch.futures.Future() for _ in range(3))
    for name, fut in (("first", first), ("second", second), ("third", third)):
        queue.add(fut, lambda f, name=name: ran.append((name, f.value())))
    second.set_result(2)
    third.set_result(3)
    queue.poll()
    assert ran == [] and len(queue) == 3  # the oldest is still pending: nothing overtakes it
    first.set_result(1)
    queue.poll()
    assert ran == [("first", 1), ("second", 2), ("third", 3)] and len(queue) == 0


def test_a_waiting_poll_waits_for_every_future_and_runs_each_on_the_polling_thread():
    queue, ran = PollQueue(), []
    futures = [_completing_later(i, 0.05 * (3 - i)) for i in range(3)]
    for fut in futures:
        queue.add(fut, lambda f: ran.append((f.value(), threading.get_ident())))
    queue.poll(wait=True)
    assert ran == [(i, threading.get_ident()) for i in range(3)]


def test_a_failed_future_reaches_its_function_and_the_poll_goes_on():
    queue, seen = PollQueue(), []
    failed, fine = torch.futures.Future(), torch.futures.Future()

    def read(f):
        try:
            seen.append(f.value())
        except RuntimeError as exc:
            seen.append(str(exc))

    queue.add(failed, read)
    queue.add(fine, read)
    failed.set_exception(RuntimeError("peer gone"))
    fine.set_result("ok")
    queue.poll(wait=True)
    assert seen == ["peer gone", "ok"]


def test_polled_rounds_run_on_the_polling_thread_in_slot_order_with_callback_rounds():
    issuer, decided, launched = comm.OrderedIssuer(), {}, []
    polled_input, callback_input = torch.futures.Future(), torch.futures.Future()

    def round_(name):
        def decide(value):
            decided[name] = threading.get_ident()

            def launch():
                launched.append(name)
                return comm.completed(value)

            return comm.Issue(launch)

        return (decide,)

    first = issuer.rounds(polled_input, round_("polled"), polled=True)
    second = issuer.rounds(callback_input, round_("callback"))
    threading.Thread(target=callback_input.set_result, args=("b",)).start()
    polled_input.set_result("a")
    time.sleep(0.05)
    assert not first.done() and not second.done()  # the callback's launch waits for slot 0
    comm.poll(last_bucket=True)
    assert first.wait() == "a" and second.wait() == "b"
    assert decided["polled"] == threading.get_ident() != decided["callback"]
    assert launched == ["polled", "callback"]
    assert issuer.pending == 0


def _futures_finished_by(rank, world_size, name):
    """Which threads complete the hook's futures through DDP, and the trained parameters."""
    finishers: set[int] = set()
    hook = {
        "allreduce": commhooks.allreduce_hook,
        "fp16": commhooks.fp16_compress_hook,
    }[name]

    def watched(state, bucket):
        fut = hook(state, bucket)
        fut.add_done_callback(lambda _: finishers.add(threading.get_ident()))
        return fut

    torch.manual_seed(0)
    ours = DDP(make_mlp(), bucket_cap_mb=0.004)
    ours.register_comm_hook(None, watched)
    theirs = DDP(make_mlp(), bucket_cap_mb=0.004)
    theirs.register_comm_hook(None, _PYTORCH[name])
    for ddp in (ours, theirs):
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        for x, y in batches(rank, 3):
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
    same = all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))
    return finishers == {threading.get_ident()}, same


_PYTORCH = {
    "allreduce": torch_default.allreduce_hook,
    "fp16": torch_default.fp16_compress_hook,
}


@pytest.mark.parametrize("name", ["allreduce", "fp16"])
def test_every_bucket_is_finished_on_ddps_thread_and_matches_pytorch(name):
    for on_ddps_thread, same in run_on_ranks(_futures_finished_by, 2, name):
        assert on_ddps_thread, "a bucket was finished in a callback on gloo's thread"
        assert same


def _waiting_for_each_bucket(rank, world_size):
    """A user's hook that waits for every bucket's result before it returns, through DDP."""
    done_on_return, done_at_last = [], []
    futures = []

    def waiting(state, bucket):
        with comm.unheld_follow_ups():  # what such a caller must say (docs: half-precision)
            fut = commhooks.fp16_compress_hook(state, bucket)
        done_on_return.append(fut.done())
        return _completed(fut.wait())

    def marking(state, bucket):
        fut = commhooks.allreduce_hook(state, bucket)
        futures.append(fut)
        if bucket.is_last():
            done_at_last.append(all(f.done() for f in futures))
            futures.clear()
        return fut

    out = {}
    for name, hook in (("waiting", waiting), ("marking", marking)):
        ddp = DDP(make_mlp(), bucket_cap_mb=0.004)
        ddp.register_comm_hook(None, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        for x, y in batches(rank, 3):
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        out[name] = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
    return all(done_on_return), done_at_last, out


def _completed(value):
    fut = torch.futures.Future()
    fut.set_result(value)
    return fut


def test_every_bucket_is_finished_when_the_last_returns_or_at_once_where_the_caller_waits():
    results = run_on_ranks(_waiting_for_each_bucket, 2)
    for each_done, done_at_last, params in results:
        assert each_done, "a bucket was not finished inside unheld_follow_ups"
        assert done_at_last == [True, True, True]
        assert torch.equal(params["waiting"], results[0][2]["waiting"])
        assert torch.equal(params["marking"], results[0][2]["marking"])


def _failed_peer(rank, world_size):
    ddp = DDP(make_mlp(), bucket_cap_mb=0.004)
    ddp.register_comm_hook(None, commhooks.fp16_compress_hook)
    ((x, y),) = batches(rank, 1)
    step = lambda: torch.nn.functional.mse_loss(ddp(x), y).backward()  # noqa: E731
    step()
    dist.barrier()
    if rank == 1:  # never joins the next step's sums, which time out on rank 0
        time.sleep(6.0)
        return None
    try:
        step()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_a_sum_that_times_out_fails_ddps_step_with_the_backends_error():
    message = run_on_ranks(_failed_peer, 2, pg_timeout=2.0)[0]
    assert "imed out" in message, message  # gloo's own words, not a failed cast of the result
