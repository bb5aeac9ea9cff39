"""Run a function on several local ranks (gloo) and get each rank's result back.

Used by the package's own test suite and by ``commhooks bench``, and handy for testing a
custom hook::

    def check(rank: int, world_size: int) -> float:
        ...  # build a DDP model, train, return something picklable
        return loss

    results = run_on_ranks(check, world_size=2)

Ranks are forked from a server that has imported torch already, and meet through a file store
in a private directory (no port to race for). A rank that raises has its traceback re-raised
here, one that dies the tail of its output shown, one that hangs is killed after ``timeout``
seconds; every rank is gone when the call returns.
"""

import datetime
import faulthandler
import io
import multiprocessing
import os
import queue as queues
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.context import ForkServerContext, ForkServerProcess
from typing import Any

__all__ = ["RankError", "describe", "run_on_ranks", "start_fork_server"]

# Imported once by the fork server, so that no rank pays for them: DDP imports torch._dynamo
# when it is built, which alone takes seconds on a small machine. Not commhooks: each rank
# imports it from the parent's sys.path (a checkout, a virtual environment...).
_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.nn", "torch.nn.parallel"]
_LAST_WORDS_S = 0.5  # how long a message already in flight may take to arrive


class RankError(RuntimeError):
    """A rank raised, died, or did not finish in time: ``rank``, the first that failed, and
    ``summary``, one line saying what went wrong."""

    def __init__(self, rank: int, summary: str, details: str) -> None:
        super().__init__(f"{summary}\n{details}" if details else summary)
        self.rank = rank
        self.summary = summary


def _context() -> ForkServerContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def start_fork_server() -> None:
    """Start the fork server now (it imports torch: seconds), not inside the first run timed."""
    proc = _context().Process(target=os.getpid)  # returns once the server has forked it
    proc.start()
    proc.join()


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout: float = 120.0,
    backend: str | None = "gloo",
    pg_timeout: float = 60.0,
    env: dict[str, str] | None = None,
    prepare: Callable[[int], None] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes.

    Each has an initialised default process group, one intra-op thread, and torchrun's
    variables (``env`` adds or overrides some). ``fn`` and ``prepare`` must be importable
    (module-level, or partials of such); ``fn`` returns something picklable.

    Args:
        backend: the default group's; ``None`` names none, as ``init_process_group()`` does.
        prepare: called as ``prepare(rank)`` in each rank before its process group is set up,
            for what must precede any connection (entering a network namespace, say).

    Returns:
        the return values, indexed by rank.

    Raises:
        RankError: with the failing rank's traceback or output; the other ranks are killed.
    """
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="commhooks-ranks-") as tmp:
        results: Any = ctx.Queue()
        logs = [os.path.join(tmp, f"rank{r}.log") for r in range(world_size)]
        setup = _Setup(
            os.path.join(tmp, "store"),
            backend,
            pg_timeout,
            dict(env or {}),
            prepare,
            fn,
            args,
            kwargs,
        )
        procs = [
            ctx.Process(
                target=_rank_main, args=(rank, world_size, setup, results, logs[rank]), daemon=True
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        try:
            return _collect(procs, results, logs, timeout)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join(5)


@dataclass(frozen=True)
class _Setup:
    """What every rank is to do: where and how to meet, what to do first, what to call."""

    store: str
    backend: str | None
    pg_timeout: float
    env: dict[str, str]
    prepare: Callable[[int], None] | None
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def _collect(
    procs: list[ForkServerProcess], results: Any, logs: list[str], timeout: float
) -> list[Any]:
    import torch

    done: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(done) < len(procs):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(set(range(len(procs))) - set(done))
            raise RankError(
                missing[0],
                f"ranks {missing} did not finish within {timeout:.0f}s",
                _tails(logs, missing),
            )
        try:
            status, rank, summary, payload = results.get(timeout=min(remaining, 0.5))
        except queues.Empty:
            _raise_if_dead(procs, done, results, logs)
            continue
        if status == "error":
            killed = _killed_by_signal(procs, done)
            details = f"rank {rank} raised:\n{payload}"
            if killed:  # the cause, where another rank's crash made this one raise
                details += f"\nranks {killed} died by a signal:\n{_tails(logs, killed)}"
            raise RankError(rank, summary, details)
        done[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    return [done[r] for r in range(len(procs))]


def _raise_if_dead(
    procs: list[ForkServerProcess], done: dict[int, Any], results: Any, logs: list[str]
) -> None:
    dead = [
        r for r, p in enumerate(procs) if r not in done and not p.is_alive() and p.exitcode != 0
    ]
    if not dead:
        return
    time.sleep(_LAST_WORDS_S)
    if results.empty():
        code = procs[dead[0]].exitcode
        raise RankError(dead[0], f"rank {dead[0]} died with exit code {code}", _tails(logs, dead))


def _killed_by_signal(procs: list[ForkServerProcess], done: dict[int, Any]) -> list[int]:
    """The ranks a signal ended (a crash's SIGSEGV, say)."""
    return [r for r, p in enumerate(procs) if r not in done and (p.exitcode or 0) < 0]


def _tails(logs: list[str], ranks: list[int], chars: int = 3000) -> str:
    parts = []
    for r in ranks:
        try:
            with open(logs[r], errors="replace") as f:
                text = f.read()[-chars:]
        except OSError:
            text = "(no output)"
        parts.append(f"--- output of rank {r} ---\n{text}")
    return "\n".join(parts)


def describe(exc: BaseException) -> str:
    """One line: the exception's type and message, or where it was raised if it has none."""
    text = str(exc).strip().splitlines()
    if text:
        return f"{type(exc).__name__}: {text[0]}"[:500]
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return type(exc).__name__
    last = frames[-1]
    where = f"{os.path.basename(last.filename)}:{last.lineno}"
    return f"{type(exc).__name__} (raised in {last.name}, {where})"


def _rank_main(rank: int, world_size: int, setup: _Setup, results: Any, log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    faulthandler.enable()  # a crash's Python stacks in the log, which a RankError quotes
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
            # Every rank waits (on the store) until every process group is built: a rank that
            # ran a function without collectives and left could otherwise close its
            # connections while another was still setting them up ("Connection closed by
            # peer" in connectFullMesh).
            "TORCH_DIST_INIT_BARRIER": "1",
        }
    )
    os.environ.update(setup.env)
    try:
        result = _run(rank, world_size, setup)
    except BaseException as exc:
        _send(results, ("error", rank, describe(exc), traceback.format_exc()))
        os._exit(1)  # skip teardown: the other ranks may be stuck in a collective
    _send(results, ("ok", rank, "", result))
    import torch.distributed as dist

    dist.destroy_process_group()


def _send(results: Any, message: tuple[str, int, str, Any]) -> None:
    """Put ``message`` and wait until it has left this process."""
    results.put(message)
    results.close()
    results.join_thread()


def _run(rank: int, world_size: int, setup: _Setup) -> bytes:
    """Prepare, join the process group, call the function; its result, serialised."""
    if setup.prepare is not None:
        setup.prepare(rank)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        setup.backend,
        init_method=f"file://{setup.store}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=setup.pg_timeout),
    )
    buf = io.BytesIO()
    torch.save(setup.fn(rank, world_size, *setup.args, **setup.kwargs), buf)
    return buf.getvalue()
