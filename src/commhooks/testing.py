"""Run a function on several local ranks (gloo) and get each rank's result back.

Used by the package's own test suite, and handy for testing a custom hook::

    def check(rank: int, world_size: int) -> float:
        ...  # build a DDP model, train, return something picklable
        return loss

    results = run_on_ranks(check, world_size=2)

Ranks are started from a fork server that has already imported torch, so each costs a fork,
not an interpreter start. They rendezvous through a file store in a private directory (no port
to race for). A rank that raises has its traceback re-raised here; one that dies has the tail
of its output shown; one that hangs is killed after ``timeout`` seconds.
"""

import datetime
import io
import multiprocessing
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["RankError", "run_on_ranks"]

_PRELOAD = ["torch", "torch.distributed", "torch.nn", "torch.nn.parallel"]


class RankError(RuntimeError):
    """A rank raised, died, or did not finish in time."""


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    pg_timeout: float = 60.0,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes.

    Each process has an initialised default process group, one intra-op thread, and the
    torchrun variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) set;
    ``env`` adds or overrides variables. ``fn`` must be importable (defined at module level)
    and return something picklable (tensors are fine).

    Returns:
        the return values, indexed by rank.

    Raises:
        RankError: with the failing rank's traceback or output.
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    with tempfile.TemporaryDirectory(prefix="commhooks-ranks-") as tmp:
        queue = ctx.Queue()
        logs = [os.path.join(tmp, f"rank{r}.log") for r in range(world_size)]
        spec = (os.path.join(tmp, "store"), backend, pg_timeout, dict(env or {}))
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(rank, world_size, spec, fn, args, kwargs, queue, logs[rank]),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        try:
            return _collect(procs, queue, logs, timeout)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join(5)


def _collect(procs: list[Any], queue: Any, logs: list[str], timeout: float) -> list[Any]:
    import torch

    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(results) < len(procs):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(set(range(len(procs))) - set(results))
            raise RankError(
                f"ranks {missing} did not finish within {timeout:.0f}s.\n" + _tails(logs, missing)
            )
        try:
            status, rank, payload = queue.get(timeout=min(remaining, 0.5))
        except Exception:
            dead = [
                r
                for r, p in enumerate(procs)
                if r not in results and not p.is_alive() and p.exitcode != 0
            ]
            if dead:
                time.sleep(0.5)  # let a message already in flight arrive
                if queue.empty():
                    raise RankError(
                        f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}.\n"
                        + _tails(logs, dead)
                    ) from None
            continue
        if status == "error":
            raise RankError(f"rank {rank} raised:\n{payload}")
        results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    return [results[r] for r in range(len(procs))]


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


def _rank_main(
    rank: int,
    world_size: int,
    spec: tuple[str, str, float, dict[str, str]],
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    queue: Any,
    log: str,
) -> None:
    store, backend, pg_timeout, env = spec
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        }
    )
    os.environ.update(env)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            backend,
            init_method=f"file://{store}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        result = fn(rank, world_size, *args, **kwargs)
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put(("ok", rank, buf.getvalue()))
    except BaseException:
        queue.put(("error", rank, traceback.format_exc()))
        queue.close()
        queue.join_thread()
        os._exit(1)  # skip teardown: the other ranks may be stuck in a collective
    queue.close()
    queue.join_thread()
    dist.destroy_process_group()
