"""The ordering guarantee of ``comm.OrderedIssuer``, without any process group."""

import random
import threading

import pytest
import torch

from commhooks import comm


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
