"""Run many small multi-rank scenarios at once, in each of which one rank kills or stops itself.

A scenario is a module-level function ``fn(rank, world_size, fault)`` run on every rank of its
own gloo world (a file store of its own, ``init_process_group(timeout=TIMEOUT)``). The victim
rank calls ``fault.strike(rank)`` (or arms a patch that does) at the point under test: it
writes the time, then sends itself a real signal, SIGKILL or SIGSTOP. Every other rank must
then raise, and the harness records when.

Scenarios mostly sit waiting for a timeout, so they are all launched together: the set takes
about one timeout of wall time instead of one per scenario. Stopped processes are killed at
the end, whatever happened.
"""

import datetime
import functools
import multiprocessing
import os
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_PRELOAD = ["torch", "torch.distributed", "torch.nn", "torch.nn.parallel"]


@dataclass(frozen=True)
class Fault:
    """What the victim does at the fault point: note the time, then signal itself."""

    victim: int
    signum: int
    stamp: str

    def strike(self, rank: int) -> None:
        if rank != self.victim:
            return
        with open(self.stamp, "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), self.signum)
        time.sleep(60)  # SIGKILL/SIGSTOP take effect at once; never go on past the fault

    def strike_on_call(self, rank: int, owner: Any, name: str, when: Callable[..., bool]) -> None:
        """On the victim, patch ``owner.name`` to strike when called with arguments ``when``
        accepts (from whatever thread makes the call)."""
        if rank != self.victim:
            return
        original = getattr(owner, name)

        @functools.wraps(original)
        def patched(*args: Any, **kwargs: Any) -> Any:
            if when(*args, **kwargs):
                self.strike(rank)
            return original(*args, **kwargs)

        setattr(owner, name, patched)


@dataclass
class Scenario:
    """One fault: which function, on how many ranks, which rank is the victim, which signal."""

    name: str
    fn: Callable[..., Any]
    world_size: int
    victim: int
    signum: int
    env: Callable[[int], dict[str, str]] | None = None


@dataclass
class Outcome:
    """What one scenario's ranks did: per survivor, ``(error or None, time it returned)``."""

    fault_time: float | None
    survivors: dict[int, tuple[str | None, float]] = field(default_factory=dict)
    missing: list[int] = field(default_factory=list)
    logs: dict[int, str] = field(default_factory=dict)

    def delays(self) -> dict[int, float]:
        """Seconds from the fault to each survivor's return."""
        assert self.fault_time is not None
        return {r: t - self.fault_time for r, (_, t) in self.survivors.items()}


def run_scenarios(scenarios: list[Scenario], timeout: float, deadline: float) -> list[Outcome]:
    """Run every scenario concurrently; wait at most ``deadline`` seconds for the survivors.

    One launcher process imports everything once and forks every rank from it, so that forty
    ranks cost forty forks, not forty imports of the test modules.
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    receive, send = ctx.Pipe(duplex=False)
    launcher = ctx.Process(target=_launch, args=(scenarios, timeout, deadline, send))
    launcher.start()
    try:
        if not receive.poll(deadline + 60):
            raise RuntimeError("the fault scenarios' launcher did not report")
        outcomes: list[Outcome] = receive.recv()
        return outcomes
    finally:
        if launcher.is_alive():
            launcher.kill()
        launcher.join(10)


def _launch(scenarios: list[Scenario], timeout: float, deadline: float, send: Any) -> None:
    ctx = multiprocessing.get_context("fork")  # nothing has run here yet: forking is safe
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="commhooks-faults-") as tmp:
        procs: list[Any] = []
        try:
            for i, sc in enumerate(scenarios):
                fault = Fault(sc.victim, sc.signum, os.path.join(tmp, f"fault{i}"))
                for rank in range(sc.world_size):
                    env = sc.env(rank) if sc.env else {}
                    store = os.path.join(tmp, f"store{i}")
                    args = (i, rank, sc, fault, timeout, store, env, queue, _log(tmp, i, rank))
                    procs.append(ctx.Process(target=_rank_main, args=args, daemon=True))
                    procs[-1].start()
            reports = _collect(scenarios, queue, time.monotonic() + deadline)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()  # SIGKILL ends a stopped process too
                proc.join(10)
        send.send([_outcome(i, sc, reports, tmp) for i, sc in enumerate(scenarios)])


def _log(tmp: str, i: int, rank: int) -> str:
    return os.path.join(tmp, f"log{i}-{rank}")


def _collect(scenarios: list[Scenario], queue: Any, until: float) -> dict[tuple[int, int], Any]:
    expected = {(i, r) for i, sc in enumerate(scenarios) for r in range(sc.world_size)}
    expected -= {(i, sc.victim) for i, sc in enumerate(scenarios)}
    reports: dict[tuple[int, int], Any] = {}
    while not expected <= set(reports) and time.monotonic() < until:
        try:
            i, rank, report = queue.get(timeout=0.5)
        except Exception:
            continue
        reports[(i, rank)] = report
    return reports


def _outcome(i: int, sc: Scenario, reports: dict[tuple[int, int], Any], tmp: str) -> Outcome:
    stamp = os.path.join(tmp, f"fault{i}")
    fault_time = None
    if os.path.exists(stamp):
        with open(stamp) as f:
            fault_time = float(f.read())
    out = Outcome(fault_time)
    for rank in range(sc.world_size):
        if rank == sc.victim:
            continue
        if (i, rank) in reports:
            out.survivors[rank] = reports[(i, rank)]
        else:
            out.missing.append(rank)
    for rank in range(sc.world_size):
        with open(_log(tmp, i, rank), errors="replace") as f:
            out.logs[rank] = f.read()[-2000:]
    return out


def _rank_main(
    i: int,
    rank: int,
    sc: Scenario,
    fault: Fault,
    timeout: float,
    store: str,
    env: dict[str, str],
    queue: Any,
    log: str,
) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update({"GLOO_SOCKET_IFNAME": "lo", **env})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    error: str | None = None
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=sc.world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        sc.fn(rank, sc.world_size, fault)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    queue.put((i, rank, (error, time.time())))
    queue.close()
    queue.join_thread()
    os._exit(0)  # no teardown: collectives with the victim would wait again


SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGSTOP": signal.SIGSTOP}
