"""``commhooks bench`` under a launcher: the launcher's ranks, the user's network and devices.

``torchrun ... -m commhooks bench`` starts one process per rank with ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK`` and ``MASTER_ADDR`` set (:mod:`commhooks.bench.world`). Each joins that world
(``env://``) on the plan's backend (NCCL on GPUs, gloo on CPUs), on ``cuda:LOCAL_RANK`` when it
uses NCCL, and then, every rank alike:

1. measures the network with an allreduce sweep (:mod:`commhooks.bench.linkprobe`);
2. runs every hook in turn through the same per-rank loop as the local ranks
   (:func:`commhooks.bench.worker.train_rank`): a DDP model built afresh, on a process group of
   its own made for that hook, so that a hook that breaks its group breaks nothing else;
3. after each hook, agrees on the outcome over a separate gloo group (an ``all_gather`` of
   each rank's result or error): a rank that raised, or that ran past ``--timeout`` (a
   ``SIGALRM`` ends a rank stuck in Python; a rank stuck in a collective gets the group's own
   timeout, the same), costs that hook's row, which says which rank failed first and why,
   and the run goes on with the next hook on every rank;
4. rank 0 turns the gathered results into rows and prints the same tables, answer and JSON as
   the local run (:func:`commhooks.bench.conclusion.conclude`), with the network's measured rate and
   latency.
"""

import contextlib
import datetime
import gc
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from commhooks.bench import conclusion, specs
from commhooks.bench.args import Plan
from commhooks.bench.clock import clock_for
from commhooks.bench.linkprobe import measure_link
from commhooks.bench.records import RankResult, RunOutcome
from commhooks.bench.rows import Row, make_row, pool_runs
from commhooks.bench.usermodel import BenchModelError, check_factory
from commhooks.bench.worker import train_rank
from commhooks.testing import describe

__all__ = ["HookTimeout", "ModelRefused", "deadline", "run"]

# A rank that fails waits at the agreement for the others: at most one hook's deadline plus
# one collective's timeout (both --timeout, NCCL's plus the margin) later: twice --timeout and
# the margin bound that wait.
_AGREEMENT_FACTOR = 2
_AGREEMENT_MARGIN_S = 60.0
_LOG_CHARS = 3000


class HookTimeout(RuntimeError):
    """A hook's run on this rank went past ``--timeout``."""


class ModelRefused(RuntimeError):
    """``--model`` cannot be trained on some rank; rank 0 has printed why, in one line."""


@contextlib.contextmanager
def deadline(seconds: float, what: str) -> Iterator[None]:
    """Raise :class:`HookTimeout` in this thread if the block runs longer than ``seconds``.

    A ``SIGALRM`` interrupts Python code and sleeps; a call blocked in C++ (a collective)
    returns first, on its group's timeout. Off the main thread, where signals cannot be
    handled, the block runs without a deadline.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: FrameType | None) -> None:
        raise HookTimeout(f"{what} ran past --timeout {seconds:g}s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _device(plan: Plan) -> torch.device:
    """``cuda:LOCAL_RANK`` for NCCL, the CPU for gloo."""
    assert plan.world is not None
    if plan.backend != "nccl":
        return torch.device("cpu")
    device = torch.device("cuda", plan.world.local_rank)
    torch.cuda.set_device(device)
    return device


def run(plan: Plan, argv: list[str]) -> dict[str, Any] | None:
    """Join the launcher's world, measure its network and every hook; rank 0 reports.

    Returns:
        the JSON document on rank 0, ``None`` on the other ranks.
    """
    assert plan.world is not None
    started = time.time()
    device = _device(plan)
    if plan.backend == "nccl":
        # On an error or timeout, abort the communicator but keep the process (PyTorch's
        # default ends it): the hook's row records the failure and the next hook runs.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    timeout = datetime.timedelta(seconds=plan.timeout_s)
    dist.init_process_group(plan.backend, timeout=timeout)
    agreement = dist.new_group(
        backend="gloo",
        timeout=datetime.timedelta(
            seconds=_AGREEMENT_FACTOR * plan.timeout_s + _AGREEMENT_MARGIN_S
        ),
    )
    lead = plan.world.rank == 0
    # DDP imports torch._dynamo the first time it is built (seconds, and some 170 MB): done
    # now, it counts against no hook's time or memory.
    import torch._dynamo  # noqa: F401

    try:
        _check_model(plan, device, agreement)
        if lead:
            conclusion.print_notes(plan)
            print(f"cluster: {plan.shape.text()} (WORLD_SIZE, LOCAL_WORLD_SIZE)", flush=True)
            print(f"measuring the network: allreduce sweep on {plan.ranks} ranks", flush=True)
        link = measure_link(None, device, clock_for(device), plan.shape)
        rows = _measure(plan, device, agreement)
        document = conclusion.conclude(plan, argv, rows, started, link) if lead else None
        dist.barrier(group=agreement)  # every rank leaves once rank 0 has written its files
    finally:
        dist.destroy_process_group()
    return document


def _check_model(plan: Plan, device: torch.device, agreement: Any) -> None:
    """Check ``--model`` on every rank's device, before anything is measured, and agree.

    A factory that fails on one rank fails that rank's every hook; found here, every rank
    learns it from one gather and rank 0 alone prints it, in one line, before any rank
    leaves (the launcher stops the other ranks as soon as one exits with an error).

    Raises:
        ModelRefused: on every rank, when any rank's check failed.
    """
    assert plan.world is not None
    if plan.model is None:
        return
    mine: str | None = None
    try:
        check_factory(plan.model, plan.seed, device, rank=plan.world.rank)
    except BenchModelError as exc:
        mine = str(exc)
    gathered: list[Any] = [None] * plan.world.world_size
    dist.all_gather_object(gathered, mine, group=agreement)
    failed = [(rank, said) for rank, said in enumerate(gathered) if said is not None]
    if not failed:
        return
    said = failed[0][1]
    if len(failed) < len(gathered):
        said += f" (on rank {', '.join(str(r) for r, _ in failed)} of {len(gathered)})"
    if plan.world.rank == 0:
        print(f"commhooks bench: {said}", file=sys.stderr, flush=True)
    dist.barrier(group=agreement)  # printed before any rank exits and the launcher stops it
    raise ModelRefused(said)


def _measure(plan: Plan, device: torch.device, agreement: Any) -> list[Row]:
    """Every hook, ``plan.repeat`` rounds of them in turn; one row per hook."""
    runs: dict[str, list[RunOutcome]] = {hook: [] for hook in plan.hooks}
    total, done = len(plan.hooks) * plan.repeat, 0
    for round_ in range(plan.repeat):
        for hook in plan.hooks:
            t0 = time.time()
            outcome = _run_hook(plan, hook, device, agreement)
            runs[hook].append(outcome)
            done += 1
            if plan.world is not None and plan.world.rank == 0:
                where = f", round {round_ + 1}/{plan.repeat}" if plan.repeat > 1 else ""
                status = "ok" if outcome.ok else f"FAILED: {(outcome.error or '')[:120]}"
                print(
                    f"[{done}/{total}] {hook}{where}: {time.time() - t0:.1f}s {status}", flush=True
                )
    return [
        make_row(
            h,
            None,
            pool_runs(runs[h]),
            specs.row_context(plan, h),
            shape=plan.shape,
            backend=plan.backend,
        )
        for h in plan.hooks
    ]


def _run_hook(plan: Plan, hook: str, device: torch.device, agreement: Any) -> RunOutcome:
    """``hook`` on this rank, on a process group of its own; the outcome every rank agreed."""
    assert plan.world is not None
    rank, world = plan.world.rank, plan.world.world_size
    group = dist.new_group(backend=plan.backend, timeout=_collective_timeout(plan))
    result: RankResult | None = None
    error: tuple[float, str] | None = None
    try:
        with deadline(plan.timeout_s, f"hook {hook} on rank {rank}"):
            result = train_rank(
                rank,
                world,
                specs.run_spec(plan, hook, None),
                group=group,
                device=device,
                shared_process=True,
            )
    except Exception as exc:  # the hook's row says it; the run goes on
        error = (time.time(), f"rank {rank}: {describe(exc)}")
    _release(group, failed=error is not None, device=device)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (result, error), group=agreement)
    return _agreed(gathered)


def _collective_timeout(plan: Plan) -> datetime.timedelta:
    """A hook group's timeout. gloo waits for a collective in C++, where the hook's deadline
    cannot reach it: its own timeout is the deadline. NCCL's host never waits (the clock
    polls), so the deadline comes first and aborts the group before NCCL's watchdog acts."""
    margin = _AGREEMENT_MARGIN_S if plan.backend == "nccl" else 0.0
    return datetime.timedelta(seconds=plan.timeout_s + margin)


def _release(group: Any, failed: bool, device: torch.device) -> None:
    """Free the hook's model and group; abort a group a failure may have left mid-collective
    (NCCL kernels waiting for a peer that will never send), so the device can go on."""
    gc.collect()
    with contextlib.suppress(Exception):
        if failed and device.type == "cuda":
            group.abort()
        else:
            dist.destroy_process_group(group)
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _agreed(gathered: list[Any]) -> RunOutcome:
    """One outcome from every rank's ``(result, (time, error))``: failed if any rank failed,
    naming the rank that failed first (the others usually failed waiting for it)."""
    errors = sorted(e for _, e in gathered if e is not None)
    if not errors:
        return RunOutcome(ok=True, ranks=[r for r, _ in gathered])
    first = errors[0][1]
    more = f" (then {len(errors) - 1} more rank(s))" if len(errors) > 1 else ""
    log = "\n".join(text for _, text in errors)
    return RunOutcome(ok=False, error=first + more, log=log[-_LOG_CHARS:])
