"""PowerSGD's finiteness check as on a GPU: held with the step's others, read in the follow-up.

On CUDA the check that decides whether a bucket falls back to plain allreduce is held when the
collective's future completes (``finiteness.HeldChecks``), and answered at the first follow-up
that asks, which is held until the step's last bucket: every bucket's check in one batched
reduction and one read. Here CPU tensors take that path
(``finiteness.queues`` answers yes) under ``comm.completing_inline()``, which completes futures
and holds follow-ups as NCCL does.
"""

import contextlib
from unittest import mock

import pytest
import torch
from ddp_utils import IN, OUT, FakeBucket, batches, flat_params, make_ddp, make_mlp, train

import commhooks
from commhooks import PowerSGDState, comm, finiteness, powerSGD_hook
from commhooks.testing import run_on_ranks

_WIDTHS = (IN, 48, 48, 48, OUT)  # matrices to compress, one bucket a parameter


@contextlib.contextmanager
def _queued_as_on_a_gpu(events: list[str]):
    """Hold every check as on a GPU; record when each is held, asked for, and when the held
    checks are settled (one batched reduction and one read)."""

    class Recorded(finiteness.HeldChecks):
        def hold(self, owner: object, *tensors: torch.Tensor) -> None:
            events.append("made")
            super().hold(owner, *tensors)

        def finite(self, owner: object) -> bool:
            events.append("read")
            return super().finite(owner)

        def _settle(self) -> None:
            events.append("settle")
            super()._settle()

    with comm.completing_inline(), mock.patch.object(finiteness, "HeldChecks", Recorded):
        yield


def _train(rank, world_size, single, queued):
    ddp = make_ddp(make_mlp(widths=_WIDTHS), bucket_cap_mb=0.00001)
    name = "power_sgd_single_round" if single else "power_sgd"
    state = commhooks.register(ddp, name, start_powerSGD_iter=1)
    events: list[str] = []
    steps = []
    for x, y in batches(rank, 4):
        events.clear()
        with _queued_as_on_a_gpu(events) if queued else contextlib.nullcontext():
            train(ddp, [(x, y)])
        steps.append(list(events))
    memory = {k: v.clone() for k, v in state.error_dict.items()}
    return flat_params(ddp.module), memory, steps


def _non_finite(rank, world_size, single, queued):
    gen = torch.Generator().manual_seed(rank)
    bucket = FakeBucket([torch.randn(16, 12, generator=gen), torch.randn(12, generator=gen)])
    state = PowerSGDState(None, start_powerSGD_iter=0, single_round=single)
    events: list[str] = []
    with _queued_as_on_a_gpu(events) if queued else contextlib.nullcontext():
        powerSGD_hook(state, bucket).wait()
        saved = {k: v.clone() for k, v in state.error_dict.items()}
        factors = {k: v.clone() for k, v in state.q_memory_dict.items()}
        local = torch.randn(bucket.buffer().shape, generator=gen)
        if rank == 0:
            local[3] = float("inf")
        bucket.buffer().copy_(local)
        out = powerSGD_hook(state, bucket).wait().clone()
    # The single round adds the gradient into the memory as it forms its factor and takes
    # it back out: on a GPU (queued), to the rounding of that addition.
    same = torch.allclose if single and queued else torch.equal
    exact = saved.keys() == state.error_dict.keys() and all(
        same(saved[k], state.error_dict[k]) for k in saved
    )
    kept = all(torch.equal(factors[k], state.q_memory_dict[k]) for k in factors)
    return out, exact or (single and rank == 1), kept, events


def _both(rank, world_size):
    return {
        (kind, single, queued): fn(rank, world_size, single, queued)
        for kind, fn in (("train", _train), ("non-finite", _non_finite))
        for single in (False, True)
        for queued in (False, True)
    }


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_both, 2, timeout=100)


@pytest.mark.timeout(120)
def test_every_bucket_queues_its_check_before_the_step_s_first_follow_up_reads_one(results):
    for per_rank in results:
        for single in (False, True):
            _, _, steps = per_rank["train", single, True]
            compressing = steps[1:]  # the first step is plain allreduce
            for events in compressing:
                buckets = events.count("made")
                assert buckets >= 3, events  # several buckets, each with its own check
                # Held until the last bucket: every check held before any is asked for, and
                # all of them answered at the first question, with one read.
                assert events == ["made"] * buckets + ["read", "settle"] + ["read"] * (
                    buckets - 1
                ), events


@pytest.mark.timeout(120)
def test_a_queued_check_trains_as_one_read_at_once(results):
    for per_rank in results:
        for single in (False, True):
            params, memory, _ = per_rank["train", single, True]
            plain_params, plain_memory, _ = per_rank["train", single, False]
            assert torch.equal(params, plain_params)
            assert memory.keys() == plain_memory.keys()
            assert all(torch.equal(memory[k], plain_memory[k]) for k in memory)


@pytest.mark.timeout(120)
def test_a_queued_check_falls_back_to_plain_allreduce_with_memory_and_factors_untouched(results):
    for per_rank in results:
        for single in (False, True):
            out, exact, kept, events = per_rank["non-finite", single, True]
            plain_out, _, _, _ = per_rank["non-finite", single, False]
            assert events == ["made", "read", "settle"] * 2  # each call's check, read at once
            assert exact and kept
            assert torch.isinf(out[3]) and torch.isfinite(torch.cat([out[:3], out[4:]])).all()
            assert torch.equal(out, plain_out)
